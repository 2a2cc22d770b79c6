"""Triton kernels behind the ``tiled``, ``sigmoid`` and ``fused`` verification methods.

Importing this package without a CUDA device switches Triton to its interpreter (``TRITON_INTERPRET=1``) unless
the variable is already set, so the kernels run (slowly) on CPU in CI. That must happen before the kernels are
decorated, which is why every kernel module imports this package first.

Modules, one per pass, each with both layouts (one request per program; ``*_rows_kernel``: many requests per
program, for small vocabularies): ``stats`` (fused pass 1: per-chunk max / sum-exp / argmax of logit rows),
``tiled`` (the seed paper's per-tile tau / b_k kernel), ``sample`` (pass 2 of every method: acceptance test, lazy
residual or bonus sampling by a two-level inverse CDF over per-tile masses). ``common`` holds the ``@triton.jit``
helpers both layouts share (keyed Philox uniforms bit-identical to :mod:`tilespec.verify.rng`, logit loads,
statistics, the inverse-CDF steps, output writes); ``launch`` the Python wrappers, launch plans, layout choice.
"""
from __future__ import annotations

from tilespec.env import use_triton_interpreter_without_cuda

use_triton_interpreter_without_cuda()
