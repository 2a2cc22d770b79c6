"""Request checks for :class:`SpeculativeDecoder`: bad prompts fail before any forward with one clear error.

``check_request`` runs once per ``stream()`` / ``generate()`` call on the tokenised prompts (lists of ints, no
padding). It checks what would otherwise crash deep inside a model (an ``IndexError`` in the embedding for ids out
of range) or silently decode garbage (positions past the model's trained context, where RoPE / learned position
tables extrapolate). Empty prompts and a bad ``max_new_tokens`` are rejected by the decoder itself.
"""
from __future__ import annotations

from typing import Optional, Sequence

from tilespec.verify.validation import resolve_sampling


def context_limit(model) -> Optional[int]:
    """The number of positions a decoder-only model was built for (``max_position_embeddings``), or None when its
    config does not say. Encoder-decoder targets are checked against ``max_target_positions`` by the decoder."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", None)
    config = text() if callable(text) else config
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def vocab_limit(model) -> Optional[int]:
    """Rows of the model's input embedding: valid prompt ids are [0, rows)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    return int(weight.shape[0]) if weight is not None else None


def check_request(target, draft, prompts: Sequence[Sequence[int]], max_new_tokens: int, seed=0,
                  sampling=None) -> list[int]:
    """Raise ValueError naming the problem and the fix when a prompt holds ids outside the vocabulary, when
    prompt + max_new_tokens exceeds the context of the target or the draft (the draft sees the same positions),
    when the seeds do not fit int64 / do not match the batch, a sampling value is out of range or a per-request
    sampling list has the wrong length, or a model's weights are on the meta device.
    Returns the per-request seeds (an int seed gives request i seed + i)."""
    for role, model in (("target", target), ("draft", draft)):
        sharded = getattr(model, "_tilespec_tp", None) is not None   # tensor parallel: meta stand-ins, shards elsewhere
        if hasattr(model, "parameters") and not sharded and any(p.is_meta for p in model.parameters()):
            raise ValueError(f"the {role} has weights on the meta device (created without data, e.g. under "
                             f"init_empty_weights or device_map='meta'): load its weights before decoding")
    seeds = _seed_list(seed, len(prompts))
    _check_sampling_lengths(sampling, len(prompts))
    if sampling is not None:   # bad values (temperature < 0, top_p 0, ...) fail here, before the prefill forward
        resolve_sampling(sampling, len(prompts), next(target.parameters()).device if hasattr(target, "parameters")
                         else "cpu")
    vocab = vocab_limit(target)
    if vocab is not None:
        for i, prompt in enumerate(prompts):
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} holds token id {bad[0]}, outside the model's vocabulary [0, {vocab}): "
                                 f"encode prompts with the model's own tokenizer")
    longest = max((len(p) for p in prompts), default=0)
    for role, model in (("target", target), ("draft", draft)):
        limit = context_limit(model) if model is not None else None
        if limit is not None and longest >= limit:
            raise ValueError(f"a prompt has {longest} tokens but the {role}'s context is {limit} positions "
                             f"(max_position_embeddings): shorten it to at most {limit - 1} tokens")
        if limit is not None and longest + max_new_tokens > limit:
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the {role}'s "
                             f"context of {limit} positions (max_position_embeddings): shorten the prompt or lower "
                             f"max_new_tokens to at most {limit - longest}")
    return seeds


def _seed_list(seed, batch: int) -> list[int]:
    if hasattr(seed, "tolist"):          # numpy / torch scalars and vectors
        seed = seed.tolist()
    if isinstance(seed, bool) or not isinstance(seed, (int, list, tuple)):
        raise TypeError(f"seed must be an int (request i uses seed + i) or a list of {batch} ints, got "
                        f"{type(seed).__name__}")
    seeds = [seed + i for i in range(batch)] if isinstance(seed, int) else list(seed)
    if not isinstance(seed, int) and len(seeds) != batch:
        raise ValueError(f"got {len(seeds)} seeds for {batch} requests: pass one int or one seed per request")
    bad = [s for s in seeds if not isinstance(s, int) or not -2**63 <= s < 2**63]
    if bad:
        raise ValueError(f"seed {bad[0]!r} is not an integer that fits int64 (request i uses seed + i): use a "
                         f"smaller seed, e.g. seed % 2**62")
    return seeds


def _check_sampling_lengths(sampling, batch: int) -> None:
    for name in ("temperature", "top_k", "top_p", "min_p", "lenience"):
        value = getattr(sampling, name, None)
        if isinstance(value, (list, tuple)) and len(value) != batch:
            raise ValueError(f"sampling.{name} has {len(value)} entries for {batch} requests: give one value per "
                             f"request or a single number")
