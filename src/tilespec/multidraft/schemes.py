"""One interface over every token-level selection scheme, by name.

Names (``parse_scheme``):
  ``sd``            single draft (uses candidate 1 only; the K = 1 case of every scheme)
  ``specinfer``     recursive rejection sampling (identical or non-identical drafts)
  ``spectr``        K-sequential selection with rho* (identical drafts)
  ``is``            IS + SD, truncated LP with s = 5 (the paper's default)
  ``is-lp``         IS + SD with the exact pairwise LP (s = whole proposable alphabet; small V)
  ``is-s<S>``, ``is-m<M>``, ``is-s<S>-m<M>``   truncated LP of size S and/or truncated alphabet of size M

``select(name, p, qs, tokens, stream, mask)`` returns a :class:`~.common.Selection`; ``accept_probability``
gives each scheme's exact test-pass probability [N] (formulas in :mod:`.baselines`, :mod:`.importance`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from . import baselines, importance
from .common import DTYPE, Selection, Stream

_IS = re.compile(r"^is(?:-s(\d+))?(?:-m(\d+))?$")


@dataclass(frozen=True)
class SchemeSpec:
    """A parsed scheme name: kind in {sd, specinfer, spectr, is}; s / m truncation for kind 'is'."""

    name: str
    kind: str
    s: int | None = None
    m: int | None = None


def parse_scheme(name: str) -> SchemeSpec:
    """Parse a scheme name (see the module docstring); ValueError for unknown names."""
    if not isinstance(name, str):
        raise ValueError(f"scheme must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    if key in ("sd", "single", "specinfer", "spectr"):
        return SchemeSpec(key, "sd" if key == "single" else key)
    if key == "is-lp":
        return SchemeSpec(key, "is", None, None)
    match = _IS.match(key)
    if match:
        s = int(match.group(1)) if match.group(1) else (5 if key == "is" or match.group(2) else None)
        m = int(match.group(2)) if match.group(2) else None
        return SchemeSpec(key, "is", s, m)
    raise ValueError(f"unknown multi-draft scheme {name!r}; use sd, specinfer, spectr, is, is-lp, is-s<S>, "
                     "is-m<M> or is-s<S>-m<M>")


SCHEMES = ("sd", "specinfer", "spectr", "is", "is-lp", "is-m4")


STATIC_KINDS = ("sd", "specinfer", "spectr")   # schemes that can select without a host sync (``static``)


def static_scheme(scheme: str | SchemeSpec) -> bool:
    """Whether ``scheme`` selects without a host sync (so a step verifying with it can be captured)."""
    return (scheme if isinstance(scheme, SchemeSpec) else parse_scheme(scheme)).kind in STATIC_KINDS


def select(scheme: str | SchemeSpec, p: torch.Tensor, qs: torch.Tensor, tokens: torch.Tensor, stream: Stream,
           mask: torch.Tensor | None = None, validate: bool = True, static: bool = False) -> Selection:
    """Emit one token per row from candidates tokens [N, K] ~ qs [N, K, V] so that its law is exactly p [N, V].

    validate=False skips the value checks (NaN, negative, row sums) for callers that checked once already.
    static=True (schemes in :data:`STATIC_KINDS`, with validate=False): no host sync, so a CUDA graph can capture
    it; a row whose mask has no active candidate then draws from p (the same draw as a bonus token)."""
    spec = scheme if isinstance(scheme, SchemeSpec) else parse_scheme(scheme)
    if static and spec.kind not in STATIC_KINDS:
        raise ValueError(f"scheme {spec.name!r} selects on the host (its LP); static selection takes "
                         f"{', '.join(STATIC_KINDS)}")
    if spec.kind == "sd":
        if mask is not None:
            first = mask.long().argmax(dim=1)
            only = torch.zeros_like(mask, dtype=torch.bool).scatter_(1, first[:, None], True) & mask
            return baselines.specinfer(p, qs, tokens, stream, only, validate, static)
        return baselines.specinfer(p, qs[:, :1], tokens[:, :1], stream, None, validate, static)
    if spec.kind == "specinfer":
        return baselines.specinfer(p, qs, tokens, stream, mask, validate, static)
    if spec.kind == "spectr":
        return baselines.spectr(p, qs, tokens, stream, mask, validate, static)
    return importance.importance(p, qs, tokens, stream, mask, s=spec.s, m=spec.m, validate=validate)


def _specinfer_test_pass(p: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """1 - prod_k (1 - b_k), b_k = sum min(r_{k-1}, q_k), r_k = norm((r_{k-1} - q_k)^+)."""
    r = p
    fail = torch.ones(p.shape[0], dtype=p.dtype, device=p.device)
    for k in range(qs.shape[1]):
        b = torch.minimum(r, qs[:, k]).sum(-1)
        fail = fail * (1 - b).clamp(min=0)
        resid = (r - qs[:, k]).clamp(min=0)
        r = resid / resid.sum(-1, keepdim=True).clamp(min=1e-300)
    return 1 - fail


def accept_probability(scheme: str | SchemeSpec, p: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """[N] exact probability that a candidate passes the scheme's test (all K candidates active).

    sd: sum min(p, q_1); specinfer: 1 - prod(1 - b_k); spectr: 1 - (1 - beta(rho*))^K;
    is*: p(Omega_0) sum min(p_hat, p_I).
    """
    spec = scheme if isinstance(scheme, SchemeSpec) else parse_scheme(scheme)
    p, qs = p.to(DTYPE), qs.to(DTYPE)
    if spec.kind == "sd":
        return torch.minimum(p, qs[:, 0]).sum(-1)
    if spec.kind == "specinfer":
        return _specinfer_test_pass(p, qs)
    if spec.kind == "spectr":
        k = torch.full((p.shape[0],), qs.shape[1], dtype=torch.int64, device=p.device)
        _, beta = baselines.spectr_rho(p, qs[:, 0], k)
        return 1 - (1 - beta) ** qs.shape[1]
    return importance.importance_test_pass(p, qs, s=spec.s, m=spec.m)
