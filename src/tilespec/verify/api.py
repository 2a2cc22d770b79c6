"""``verify()``: the one entry point for the accept/resample step of speculative decoding."""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from .registry import get_method, resolve_method
from .types import SamplingParams, VerifyResult
from .validation import check_shared_stream_seed, normalize_seed, prepare_inputs


def verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor, *, draft_logits: Optional[torch.Tensor] = None,
           draft_probs: Optional[torch.Tensor] = None, num_draft_tokens=None,
           sampling: SamplingParams = SamplingParams(), method: str = "reference", options: Optional[Mapping] = None,
           seed=None, generator: Optional[torch.Generator] = None, offsets=None,
           check_values: bool = True) -> VerifyResult:
    """Accept or reject each request's draft tokens and sample the next token, exactly from the target's law.

    Args:
        target_logits: [B, K+1, V] target logits at the K draft positions plus the bonus position.
        draft_tokens: [B, K] drafted token ids.
        draft_logits / draft_probs: [B, K, V] the draft distribution the tokens were sampled from (logits are
            processed with ``sampling`` like the target's). Probabilities are taken as given, never renormalised:
            every used row must be finite, non-negative and sum to 1 within 1e-3 (bf16: its epsilon, 2**-7), else
            ValueError (a row that does not sum to 1 would change the output law); with ``check_values=False`` that
            is the caller's promise. Omit both for a deterministic draft (n-gram, greedy draft): q is then one-hot
            at the drafted token.
        num_draft_tokens: [B] per-request draft lengths K_b in [0, K] (ragged batch); default K for every request.
            K_b = 0 samples only the next token from target row 0. This is how shorter drafts are expressed:
            draft positions past K_b are padding (any value, e.g. -1); a -1 at a used position is an error.
        sampling: temperature / top-k / top-p / min-p / lenience, scalars or per request.
        method: a registered method name ("reference", "hf", "tiled", "fused", "sigmoid", ...; see
            ``tilespec.verify.registry.all_methods()``), or "auto": ``fused`` on a GPU with Triton, else
            ``reference``.
        options: the method's options (e.g. sigmoid's {"alpha": -1e3, "beta": 1e3}); unset ones keep their defaults,
            unknown names raise ValueError.
        seed: int (request b uses seed + b; numpy and 0-d torch integer scalars count as ints; bools do not), or
            per-request seeds [B] (a sequence of ints or an integer tensor); None draws seeds from ``generator`` or the
            default torch generator. Random numbers are keyed by (seed, offsets + position), so a request's result
            does not depend on the rest of the batch. The exception is ``hf`` (transformers' semantics): it draws
            the whole batch from one generator seeded by request 0's seed, so its tokens depend on the batch, and
            it raises ValueError when given per-request seeds that differ.
        offsets: int or [B] absolute position of each request's first draft token (use the sequence length so
            successive steps use fresh random numbers); default 0.
        check_values: read the inputs once to reject NaN/Inf, out-of-range ids and bad per-request values (one
            host sync). Shape/dtype checks always run.

    Returns:
        VerifyResult with output_tokens [B, K+1] (-1 padded), num_accepted [B], num_emitted [B], accepted [B, K].
    """
    seed = normalize_seed(seed)   # numpy / 0-d torch integer scalars become the int they hold; bools, str: errors
    inputs = prepare_inputs(target_logits, draft_tokens, draft_logits=draft_logits, draft_probs=draft_probs,
                            num_draft_tokens=num_draft_tokens, sampling=sampling, seed=seed, generator=generator,
                            offsets=offsets, check_values=check_values)
    chosen = get_method(resolve_method(method, inputs.device))
    if not chosen.batch_invariant:
        check_shared_stream_seed(chosen.name, seed, check_values)
    result = chosen(inputs, options)
    result.method, result.exact = chosen.name, chosen.exact
    return result
