"""Triton kernels behind the ``tiled``, ``sigmoid`` and ``fused`` verification methods.

Importing this package without a CUDA device switches Triton to its interpreter (``TRITON_INTERPRET=1``) unless
the variable is already set, so the kernels run (slowly) on CPU in CI. That must happen before the kernels are
decorated, which is why every kernel module imports this package first.

Modules: ``common`` (keyed Philox uniforms bit-identical to :mod:`tilespec.verify.rng`, the inverse-CDF steps),
``stats`` (pass 1: per-chunk max / sum-exp / argmax of logit rows), ``sample`` (pass 2: acceptance test, lazy
residual or bonus sampling by a two-level inverse CDF over per-tile masses, finished by the last program done), ``tiled`` (the
seed paper's per-tile tau / a / b_k kernel), ``batched`` (the same three kernels for small vocabularies, many
requests per program), ``launch`` (the Python wrappers, launch plans, layout choice).
"""
from __future__ import annotations

from tilespec.env import use_triton_interpreter_without_cuda

use_triton_interpreter_without_cuda()
