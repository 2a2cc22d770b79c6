"""The adversarial cases of the exactness suite (small vocabularies, so the exact law is computable).

Each case is one request's logits plus the draft lengths to test; the suite replicates it over many requests
(mixing the draft lengths in one ragged batch) and compares what a method emits with :mod:`.law`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..verify.types import SamplingParams


@dataclass
class Case:
    """target_logits [K+1, V]; draft_logits / draft_probs [K, V] or neither (one-hot draft at draft_tokens [K])."""

    name: str
    target_logits: torch.Tensor
    draft_logits: Optional[torch.Tensor] = None
    draft_probs: Optional[torch.Tensor] = None
    draft_tokens: Optional[torch.Tensor] = None
    draft_lengths: tuple[int, ...] = ()       # K_b values mixed in one ragged batch; () means (K,)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    single_request: bool = False              # True: every request has the full K (the `hf` baseline's setting)

    @property
    def max_draft(self) -> int:
        return self.target_logits.shape[0] - 1

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.draft_lengths or (self.max_draft,)


def _logits(gen: torch.Generator, rows: int, vocab: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=gen) * scale


def default_cases(seed: int = 0) -> list[Case]:
    """The suite's cases: every adversarial situation known to break a sampler."""
    g = torch.Generator().manual_seed(seed)
    cases: list[Case] = []
    v = 16
    base_t, base_d = _logits(g, 6, v), _logits(g, 5, v)
    cases.append(Case("generic K=5 V=16", base_t, draft_logits=base_d, single_request=True))
    cases.append(Case("K=1 V=16", base_t[:2], draft_logits=base_d[:1], single_request=True))
    cases.append(Case("p = q", base_t[:4], draft_logits=base_t[:3].clone(), single_request=True))
    disjoint_t = torch.full((4, v), -30.0)
    disjoint_t[:, : v // 2] = _logits(g, 4, v // 2)
    disjoint_d = torch.full((3, v), -30.0)
    disjoint_d[:, v // 2:] = _logits(g, 3, v // 2)
    cases.append(Case("disjoint supports", disjoint_t, draft_logits=disjoint_d, single_request=True))
    zero_q = base_d[:3].clone()
    zero_q[:, :5] = float("-inf")
    cases.append(Case("q(x)=0 where p(x)>0", base_t[:4], draft_logits=zero_q, single_request=True))
    cases.append(Case("one-hot draft", base_t[:4], draft_tokens=torch.tensor([3, 7, 1]), single_request=True))
    probs = torch.softmax(_logits(g, 3, v), -1).double()
    cases.append(Case("draft_probs input", base_t[:4], draft_probs=(probs / probs.sum(-1, keepdim=True)).float(),
                      single_request=True))
    masked_t = base_t[:4].clone()
    masked_t[:, 10:] = float("-inf")
    masked_d = base_d[:3].clone()
    masked_d[:, 12:] = float("-inf")
    cases.append(Case("-inf masked rows", masked_t, draft_logits=masked_d, single_request=True))
    cases.append(Case("top-k 4", base_t[:4], draft_logits=base_d[:3], sampling=SamplingParams(top_k=4),
                      single_request=True))
    cases.append(Case("top-p 0.8 temperature 0.7", base_t[:4], draft_logits=base_d[:3],
                      sampling=SamplingParams(temperature=0.7, top_p=0.8), single_request=True))
    # bf16 rows take the 16-bit keep-threshold kernels (kernels/topk16.py) and, at T != 1, the correctly rounded z
    cases.append(Case("bf16 top-k 4 temperature 0.7", base_t[:4].bfloat16(), draft_logits=base_d[:3].bfloat16(),
                      sampling=SamplingParams(temperature=0.7, top_k=4), single_request=True))
    cases.append(Case("bf16 top-k 6 top-p 0.8 temperature 1.3", base_t[:4].bfloat16(),
                      draft_logits=base_d[:3].bfloat16(),
                      sampling=SamplingParams(temperature=1.3, top_k=6, top_p=0.8), single_request=True))
    # bf16 top-p / min-p without top-k take kernels/topp16.py on a GPU
    cases.append(Case("bf16 top-p 0.8 temperature 0.7", base_t[:4].bfloat16(), draft_logits=base_d[:3].bfloat16(),
                      sampling=SamplingParams(temperature=0.7, top_p=0.8), single_request=True))
    cases.append(Case("bf16 top-p 0.9 min-p 0.1 temperature 1.3", base_t[:4].bfloat16(),
                      draft_logits=base_d[:3].bfloat16(),
                      sampling=SamplingParams(temperature=1.3, top_p=0.9, min_p=0.1), single_request=True))
    cases.append(Case("min-p 0.1", base_t[:4], draft_logits=base_d[:3], sampling=SamplingParams(min_p=0.1),
                      single_request=True))
    extreme_t = _logits(g, 4, v, scale=1e4)
    extreme_d = _logits(g, 3, v, scale=1e4)
    extreme_d[0] = extreme_t[0]
    cases.append(Case("extreme logits ±1e4", extreme_t, draft_logits=extreme_d, single_request=True))
    cases.append(Case("bf16 logits", base_t[:4].bfloat16(), draft_logits=base_d[:3].bfloat16(), single_request=True))
    odd_v = 61
    cases.append(Case("V=61 (no tile multiple) K=5", _logits(g, 6, odd_v), draft_logits=_logits(g, 5, odd_v),
                      single_request=True))
    cases.append(Case("ragged K_b in {0, 2, 5}", base_t, draft_logits=base_d, draft_lengths=(0, 2, 5)))
    cases.append(Case("temperature 0", base_t[:4], draft_logits=base_d[:3], sampling=SamplingParams.greedy(),
                      single_request=True))
    close_d = base_t[:3] + 0.3 * _logits(g, 3, v, scale=1.0)
    cases.append(Case("temperature 0 vs close draft", base_t[:4], draft_logits=close_d,
                      sampling=SamplingParams.greedy(), single_request=True))
    cases.append(Case("lenience 0.5", base_t[:4], draft_logits=base_d[:3], sampling=SamplingParams(lenience=0.5)))
    cases.append(Case("lenience 0.3 greedy", base_t[:4], draft_logits=close_d,
                      sampling=SamplingParams(temperature=0.0, lenience=0.3)))
    cases += peer_cases(g, base_t)
    return cases


def peer_cases(g: torch.Generator, base_t: torch.Tensor) -> list[Case]:
    """Situations the peers' rejection-sampler tests exercise (vLLM, FlashInfer, transformers), written for our
    contract: draft_probs are normalised by the caller (verify() rejects rows that do not sum to 1)."""
    v = base_t.shape[-1]
    raw = torch.rand(3, v, generator=g, dtype=torch.float64)          # vLLM-style raw uniform draft weights
    cases = [Case("raw rand draft_probs, normalised", base_t[:4], draft_probs=(raw / raw.sum(-1, keepdim=True)).float(),
                  single_request=True)]
    same = torch.softmax(base_t[:3].double(), -1)                      # q = p: the residual is all zero (or rounding)
    cases.append(Case("draft_probs = p (zero residual)", base_t[:4], draft_probs=same.float(), single_request=True))
    one_t = torch.full((4, v), float("-inf"))
    one_t[torch.arange(4), torch.tensor([2, 5, 5, 9])] = 0.0
    one_q = torch.zeros(3, v)
    one_q[torch.arange(3), torch.tensor([2, 5, 6])] = 1.0               # agrees, agrees, then q(x) = 0 where p(x) = 1
    cases.append(Case("one-hot p and q (zero residual, then rejection)", one_t, draft_probs=one_q,
                      single_request=True))
    peaked = torch.zeros(4, v)
    peaked[:, 0] = 8.0                                                 # peaked target vs a uniform draft
    cases.append(Case("peaked target, uniform draft_probs", peaked, draft_probs=torch.full((3, v), 1.0 / v),
                      single_request=True))
    return cases


def power_cases(seed: int = 0) -> list[Case]:
    """Cases on which a sampler with 1 % of its mass moved must be caught (the suite's power check)."""
    return [c for c in default_cases(seed) if c.name in ("generic K=5 V=16", "K=1 V=16", "one-hot draft")]
