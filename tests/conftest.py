"""Test-session setup. Triton kernels run under its interpreter on machines without CUDA; the variable must be set
before any module imports triton, so it is set here, before test modules are collected."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--soak-json", default=None, help="where the GPU soak test keeps its record")
    parser.addoption("--soak-args", default="--rounds 3", help="arguments for bench/scripts/soak.py in the GPU soak test")
