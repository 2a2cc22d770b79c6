"""Request checks for :class:`SpeculativeDecoder`: bad prompts fail before any forward with one clear error.

``check_request`` runs once per ``stream()`` / ``generate()`` call on the tokenised prompts (lists of ints, no
padding). It checks what would otherwise crash deep inside a model (an ``IndexError`` in the embedding for ids out
of range) or silently decode garbage (positions past the model's trained context, where RoPE / learned position
tables extrapolate). Empty prompts and a bad ``max_new_tokens`` are rejected by the decoder itself.
"""
from __future__ import annotations

from typing import Optional, Sequence


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


def check_request(target, draft, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """Raise ValueError naming the problem and the fix when a prompt holds ids outside the vocabulary or when
    prompt + max_new_tokens exceeds the context of the target or the draft (the draft sees the same positions)."""
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
