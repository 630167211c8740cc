"""Runs the Triton attention kernels on CPU tensors through Triton's interpreter when this machine
has no GPU.

``triton.jit`` picks interpreter or compiler from TRITON_INTERPRET when a function is defined, and
triton.language's own jit helpers (tl.max, tl.sum, tl.cdiv...) are defined when triton is first
imported, so the variable only takes full effect if it is set before the process first imports
triton. This file sets it as early as this folder allows; when triton was already imported (a
parent conftest importing the engine pulls it in through torch._dynamo), the test module runs its
CPU checks in a fresh process instead. Setting it in the top-level tests/conftest.py avoids that.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
