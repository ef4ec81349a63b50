"""Attention over the paged KV cache: one metadata object per step (``metadata``), backends behind
one interface (``backends``). Nothing is imported here: ``cpu_policy`` serves the torch-free runtime."""
