"""Scenario replay: RAN KPI traces fed to the xApp as if they came from the E2 interface.

``traces`` loads CSV traces of any public layout into canonical E2SM-KPM rows through a
column mapping (``TraceSpec``), repairing and counting messy data; ``generator`` writes seeded
synthetic traces (daily load curve, bursts, cell outages) for tests and demos. Neither imports
torch, so a replay client stays light.
"""
