"""Kernel tests run on CPU through the Triton interpreter.

``TRITON_INTERPRET=1`` must be set before any ``@triton.jit`` function is defined, so it is
set here, before the test modules import the kernels.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
