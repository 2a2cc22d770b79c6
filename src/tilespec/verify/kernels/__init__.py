"""Triton kernels behind the ``tiled``, ``sigmoid`` and ``fused`` verification methods.

Importing this package without a CUDA device switches Triton to its interpreter (``TRITON_INTERPRET=1``) unless
the variable is already set, so the kernels run (slowly) on CPU in CI. That must happen before the kernels are
decorated, which is why every kernel module imports this package first.

Modules: ``stream`` (``fused`` pass 1, one request per program: per-chunk max / sum-exp / argmax of logit rows and
the acceptance test in the request's last program), ``stats`` (the same statistics for many requests per program,
small vocabularies, and the shared acceptance tail), ``residual`` (``fused`` pass 2, one request per program: row
n's residual or bonus draw, several tiles per program), ``sample`` (pass 2 of ``sigmoid`` / ``tiled``, and of
``fused`` for small vocabularies: acceptance test, lazy residual, two-level inverse CDF over per-tile masses),
``tiled`` (the seed paper's per-tile tau / b_k kernel). ``common`` holds the ``@triton.jit`` helpers they share
(keyed Philox uniforms bit-identical to :mod:`tilespec.verify.rng`, logit loads, statistics, the inverse-CDF steps,
output writes); ``launch`` the Python wrappers, launch plans and layout choice, ``direct`` the compiled-kernel
launcher. Keep thresholds of the filters: ``keep`` (routing), ``thresholds`` / ``radix`` (32-bit order-key search,
one or many programs per row), ``topk16`` with ``pivot16`` / ``digits16`` / ``keys16`` (top-k, then top-p / min-p,
of 16-bit rows), ``topp16`` (top-p / min-p of 16-bit rows from a count window of order keys).
"""
from __future__ import annotations

from tilespec.env import use_triton_interpreter_without_cuda

use_triton_interpreter_without_cuda()
