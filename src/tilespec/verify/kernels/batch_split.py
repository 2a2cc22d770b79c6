"""Batches of any size for the verification kernels: launch over slices of at most MAX_GRID_ROWS requests.

The per-request kernels put the request index on CUDA grid axis 1 or 2 (``launch``: pass 1 (chunks, rows, B),
pass 2 (tiles, B, 1), ``tiled`` pass 1 (tiles, K, B)), whose limit is 65,535 programs; a larger grid fails with
``CUDA invalid argument``. :func:`per_slices` runs a method on consecutive slices [b0, b0 + MAX_GRID_ROWS) of the
batch and concatenates the results along B.

Same law, same tokens: every random number is keyed by the request's own seed and offset (sliced with its rows),
and the kernels are batch invariant (chunk / tile sizes depend on V alone), so request b gets the bits it would get
in one launch (tests/test_kernels_batch_split.py checks it with a small MAX_GRID_ROWS). Slices of the same size
share one launch plan and its scratch; they run one after another on the current stream, so that is safe. Within
a slice the kernels' int32 index arithmetic is bounded by the slice (row offsets into the logits are int64).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..types import VerifyInputs, VerifyResult

MAX_GRID_ROWS = 65535      # CUDA's limit on grid axes 1 and 2 (tests shrink it to exercise several slices)
MAX_DRAFT = 32767          # pass 1 puts the 2K + 1 rows of a request on axis 1: K beyond this cannot launch

_PER_REQUEST = ("temperature", "top_k", "top_p", "min_p", "lenience")   # ResolvedSampling's [B] tensors


def slice_inputs(inputs: VerifyInputs, b0: int, b1: int) -> VerifyInputs:
    """Requests b0 .. b1 - 1 of ``inputs`` as views (K_max, V, the flags and the generator unchanged; the flags of
    ResolvedSampling are conservative, so they stay valid for a subset)."""
    cut = slice(b0, b1)
    sampling = dataclasses.replace(inputs.sampling, **{f: getattr(inputs.sampling, f)[cut] for f in _PER_REQUEST})
    return dataclasses.replace(
        inputs, target_logits=inputs.target_logits[cut], draft_tokens=inputs.draft_tokens[cut],
        num_draft_tokens=inputs.num_draft_tokens[cut], sampling=sampling, seeds=inputs.seeds[cut],
        offsets=inputs.offsets[cut],
        draft_logits=None if inputs.draft_logits is None else inputs.draft_logits[cut],
        draft_probs=None if inputs.draft_probs is None else inputs.draft_probs[cut])


def concat_results(parts: list) -> VerifyResult:
    """One VerifyResult from the results of consecutive slices (outputs concatenated along B)."""
    first = parts[0]
    return VerifyResult(output_tokens=torch.cat([p.output_tokens for p in parts]),
                        num_accepted=torch.cat([p.num_accepted for p in parts]),
                        num_emitted=torch.cat([p.num_emitted for p in parts]),
                        accepted=torch.cat([p.accepted for p in parts]), method=first.method, exact=first.exact,
                        extras=dict(first.extras))


def per_slices(fn):
    """Decorator for ``fn(inputs: VerifyInputs, *args) -> VerifyResult``: batches above MAX_GRID_ROWS requests run
    as consecutive slices (see the module docstring); smaller ones call ``fn`` once, unchanged. K_max above
    MAX_DRAFT raises ValueError (no slicing helps there)."""
    @functools.wraps(fn)
    def run(inputs: VerifyInputs, *args, **kwargs) -> VerifyResult:
        if inputs.max_draft > MAX_DRAFT:
            raise ValueError(f"the Triton verification kernels take at most {MAX_DRAFT} draft tokens per request "
                             f"(got K_max = {inputs.max_draft}); use method='reference'")
        batch, step = inputs.batch_size, MAX_GRID_ROWS
        if batch <= step:
            return fn(inputs, *args, **kwargs)
        return concat_results([fn(slice_inputs(inputs, b0, min(b0 + step, batch)), *args, **kwargs)
                               for b0 in range(0, batch, step)])
    return run

