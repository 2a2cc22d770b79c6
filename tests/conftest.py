"""Test-session setup. Triton kernels run under its interpreter on machines without CUDA; the variable must be set
before any module imports triton, so it is set here, before test modules are collected."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
