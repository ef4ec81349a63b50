"""Scenario replay: RAN KPI traces fed to the xApp as if they came from the E2 interface.

One module per job:

- ``traces``: CSV traces of any public layout -> canonical E2SM-KPM rows, through a column
  mapping (``TraceSpec``), repairing and counting messy data; ``generator``: seeded synthetic
  traces (daily load curve, bursts, cell outages) for tests and demos.
- ``schema``: the scenario file's pydantic models; ``expressions``: the threshold language;
  ``prompts``: user-prompt templates (sandboxed jinja2);
  ``templates``: a scenario's RAN templates (conversation, constraint, reference policy) and
  their checks; ``decisions``: whether an answer is valid and correct.
- ``loading``: a scenario from a path or a bundled name, ``--set`` overrides, problems with their
  YAML line; ``planning``: the seeded, open-loop request plan.
- ``runner``: the replay loop over a backend, ``engine_backend`` (in-process) or ``zmq_backend``
  (a running ``ricllm serve``); ``reporting``: the run's report.json, from its records;
  ``cli``: ``ricllm replay``.

What a run records (``RequestRecord``), its compliance targets and their aggregates live in
``ricllm.report``, below replay: a report is read and rendered from report.json alone.

Only ``engine_backend`` loads torch (when it loads the engine), so a replay over ZeroMQ stays light.
"""
