"""Model execution: what runs the model once per engine step.

- ``interface``: the ``Runtime`` the engine holds (model, KV store, runner, sampler, device), with
  its ``capabilities`` (``capabilities``: the kernel limits the policies above follow).
- ``choice``: which runtime serves a configuration (``build_runtime``), and why.
- ``torch_runtime`` with ``llama`` (the network, as the math), ``llama_weights`` (loading and
  packing its weights), ``llama_fused`` (the C kernels swapped in), ``model_runner``, ``sampler``
  and ``weight_cache`` (its converted weights on disk): the torch model on any device.
- ``native_runtime`` with ``native_model``, ``numpy_sampler`` and ``native_convert`` (its weights,
  converted by the torch runtime's code): ricllm's C kernels, no torch.
- ``flat_batch``: a scheduled batch laid out flat, what both runners turn into arrays.

Nothing is imported here: importing one runtime must not load the other's dependencies (torch).
"""
