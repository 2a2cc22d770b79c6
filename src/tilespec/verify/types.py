"""Data types of the verification contract: sampling parameters, prepared inputs, results.

Shapes use B = requests in the batch, K = K_max = the longest draft in the batch, V = vocabulary size.
Request b drafted ``num_draft_tokens[b] = K_b <= K`` tokens; its target rows are ``target_logits[b, :K_b + 1]``
and every row past that is padding that no method may read into its result.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

Scalar = Union[int, float]
PerRequest = Union[Scalar, Sequence[Scalar], torch.Tensor]


@dataclass(frozen=True)
class SamplingParams:
    """How target and draft logits become distributions; applied identically to both.

    Each field is a Python number (same for every request) or a per-request sequence / tensor of shape [B].

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k largest logits (ties at the k-th value are kept); 0 disables.
    top_p: keep token x iff the mass of the tokens with a strictly larger logit is < top_p (the smallest most-
        probable set whose mass reaches top_p, with ties at its edge all kept); 1 disables. Must be in (0, 1].
    min_p: keep tokens with p(x) >= min_p * max p; 0 disables. Must be in [0, 1].
    lenience: Leviathan et al. App. A.5 factor l in (0, 1]; 1 is exact speculative sampling. With l < 1 a draft
        token x is accepted with probability min(1, p(x) / (l q(x))) and a rejection resamples from
        norm(max(0, p - l q)); no token is then emitted with probability above p(x) / l. With temperature 0 and
        l < 1 a draft token is accepted when p1(x) >= l * max p1, p1 being the temperature-1 distribution.

    The order is temperature, top-k, top-p, min-p (Hugging Face's warper order).
    """

    temperature: PerRequest = 1.0
    top_k: PerRequest = 0
    top_p: PerRequest = 1.0
    min_p: PerRequest = 0.0
    lenience: PerRequest = 1.0

    @classmethod
    def greedy(cls) -> "SamplingParams":
        return cls(temperature=0.0)


@dataclass
class ResolvedSampling:
    """SamplingParams broadcast to per-request tensors on the logits' device, plus flags that let methods skip work.

    temperature, top_p, min_p, lenience: float32 [B]; top_k: int64 [B] (0 = off).
    The ``has_*`` / ``all_greedy`` flags are Python bools computed without a device sync when the parameters were
    Python numbers; for tensor parameters they are conservatively True (the method then applies the step, which is
    a no-op for disabled requests).
    ``top_k_range`` lets selection passes size a ``torch.topk`` without reading the device (None: unknown).
    Tensors built from Python values are cached constants shared by later calls (see ``validation.resolve_sampling``):
    read them, never modify them in place.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    lenience: torch.Tensor
    any_greedy: bool
    all_greedy: bool
    has_top_k: bool
    has_top_p: bool
    has_min_p: bool
    has_lenience: bool
    top_k_range: Optional[tuple] = None   # (min, max) of top_k when given as Python numbers, else None

    @property
    def has_filters(self) -> bool:
        return self.has_top_k or self.has_top_p or self.has_min_p


@dataclass
class VerifyInputs:
    """Validated inputs handed to a verification method.

    target_logits: [B, K+1, V] float (bf16/fp16/fp32), not copied or upcast.
    draft_logits:  [B, K, V] float or None.  draft_probs: [B, K, V] float or None (at most one of the two is set;
                   neither means the draft is deterministic, i.e. one-hot at the drafted token).
    draft_tokens:  [B, K] int64, padding positions hold arbitrary values in [0, V).
    num_draft_tokens: [B] int64, 0 <= K_b <= K.
    seeds:   [B] int64 per-request seeds of the counter-based random stream.
    offsets: [B] int64 absolute position of each request's first draft token; random numbers are keyed by
             (seed, offset + row, purpose, token) so they never depend on batch composition or order.
    generator: the torch.Generator the caller passed (only the `hf` baseline draws from it directly).
    Tensors are the caller's own where they were given with the right device and dtype, otherwise converted copies or
    cached constants (K_max per request, zero offsets, int seeds): methods read them and never modify them in place.
    """

    target_logits: torch.Tensor
    draft_tokens: torch.Tensor
    num_draft_tokens: torch.Tensor
    sampling: ResolvedSampling
    seeds: torch.Tensor
    offsets: torch.Tensor
    draft_logits: Optional[torch.Tensor] = None
    draft_probs: Optional[torch.Tensor] = None
    generator: Optional[torch.Generator] = None
    ragged: bool = True

    @property
    def batch_size(self) -> int:
        return self.target_logits.shape[0]

    @property
    def max_draft(self) -> int:
        return self.draft_tokens.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.target_logits.shape[2]

    @property
    def device(self) -> torch.device:
        return self.target_logits.device


@dataclass
class VerifyResult:
    """Outcome of one verification step.

    output_tokens: [B, K+1] int64; request b emitted output_tokens[b, :num_emitted[b]], the rest is -1.
        The first num_accepted[b] entries are the accepted draft tokens, the last emitted one is the resampled
        token (after a rejection) or the bonus token (all K_b accepted).
    num_accepted: [B] int64 in [0, K_b].   num_emitted: [B] int64 = num_accepted + 1.
    accepted: [B, K] bool; accepted[b, i] is True iff draft token i was accepted (so it is a prefix of True).
    method / exact: which method produced this and whether it samples exactly from the target law.
    """

    output_tokens: torch.Tensor
    num_accepted: torch.Tensor
    num_emitted: torch.Tensor
    accepted: torch.Tensor
    method: str = ""
    exact: bool = True
    extras: dict = field(default_factory=dict)

    def tokens(self, b: int) -> list[int]:
        """The tokens request b emitted, as a Python list (syncs with the device)."""
        n = int(self.num_emitted[b])
        return self.output_tokens[b, :n].tolist()


def result_from_counts(output_tokens: torch.Tensor, num_accepted: torch.Tensor, max_draft: int,
                       method: str, exact: bool) -> VerifyResult:
    """Build a VerifyResult from the padded tokens and accept counts (derives num_emitted and flags)."""
    positions = torch.arange(max_draft, device=num_accepted.device)
    accepted = positions[None, :] < num_accepted[:, None]
    return VerifyResult(output_tokens=output_tokens, num_accepted=num_accepted, num_emitted=num_accepted + 1,
                        accepted=accepted, method=method, exact=exact)
