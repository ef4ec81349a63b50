"""Model execution: what runs the model once per engine step.

- ``interface``: the ``Runtime`` the engine holds (model, KV store, runner, sampler, device).
- ``choice``: which runtime serves a configuration (``build_runtime``), and why.
- ``torch_runtime`` with ``model_runner`` and ``sampler``: the torch model on any device.
- ``native_runtime`` with ``native_model`` and ``numpy_sampler``: ricllm's C kernels, no torch.
- ``flat_batch``: a scheduled batch laid out flat, what both runners turn into arrays.

Nothing is imported here: importing one runtime must not load the other's dependencies (torch).
"""
