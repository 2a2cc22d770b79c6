"""One request's logit transforms (:class:`LogitSettings`: OpenAI's penalties and ``logit_bias``, vLLM's
``min_tokens``) and their value checks, without torch: a server's API process builds and checks them before a
request reaches the engine, and imports nothing of the tensor code (verify/logit_transforms.py applies them)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class LogitSettings:
    """One request's transforms. ``presence_penalty`` / ``frequency_penalty``: OpenAI's, in [-2, 2], over the
    request's generated tokens (not the prompt); ``logit_bias``: token id -> bias in [-100, 100] (at most 300 ids);
    ``min_tokens``: ``banned`` ids (the request's stop ids: EOS unless it ignores EOS, and its stop_token_ids) get
    -inf until it has generated that many tokens."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)
    min_tokens: int = 0
    banned: tuple = ()

    @property
    def active(self) -> bool:
        """Whether this changes any logit (an inactive request needs no transform at all)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or (self.min_tokens > 0 and self.banned))

    def check(self, vocab: Optional[int]) -> None:
        """Raise ValueError naming the field when a value is out of range (ids checked against ``vocab``)."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if len(self.logit_bias) > 300:
            raise ValueError(f"logit_bias takes at most 300 token ids, got {len(self.logit_bias)}")
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or isinstance(tok, bool) or not (vocab is None or 0 <= tok < vocab):
                raise ValueError(f"logit_bias key {tok!r} is not a token id in [0, {vocab})")
            if not (isinstance(bias, (int, float)) and math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise ValueError(f"logit_bias[{tok}] must be a number in [-100, 100], got {bias!r}")
        if not (isinstance(self.min_tokens, int) and self.min_tokens >= 0):
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        for tok in self.banned:
            if not isinstance(tok, int) or not (vocab is None or 0 <= tok < vocab):
                raise ValueError(f"stop token id {tok!r} is not a token id in [0, {vocab})")
