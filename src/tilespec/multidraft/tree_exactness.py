"""Exactness suite of the tree sampler (:func:`~.tree.select_tree`; ``tilespec check exactness --method tree``).

Sequence level on a tiny vocabulary: an order-1 Markov target (logits table L [V, V], processed with the case's
SamplingParams: temperature and filters) and a draft law Q [V, V]. Every row starts from context token 0; each round
builds one tree per row from the row's last token, scores it with the target table and selects with ``select_tree``;
rounds repeat until three tokens are out. The law of (y1, y2, y3) must be P(0, y1) P(y1, y2) P(y2, y3) (G-test and
chi-square over V^3 bins, :func:`~tilespec.exactness.stats.fit_test`).

Trees: ``distinct`` = a fixed shape whose node tokens are the top-k of Q under the parent's token (deterministic
drafts, EAGLE-style), optionally with a repeated sibling token and ragged per-row sizes; ``iid`` = every node's
children drawn independently from Q under its token (K sampled chains, or a sampled 2-2 tree), selected with the
multi-draft schemes. Power check: ``tree:planted-no-renorm`` skips the renormalisation by the rejected siblings'
mass (accepts x_k with probability p(x_k) instead of p(x_k) / (1 - p(x_1..x_{k-1}))) and must FAIL.
"""
from __future__ import annotations

import time

import torch

from ..exactness.stats import CaseResult, fit_test, summarize
from ..verify.distributions import log_probs
from ..verify.types import SamplingParams
from ..verify.validation import resolve_sampling
from .common import DTYPE
from .tree import TokenTree, select_tree
from .tree_distinct import select_distinct

V = 4
EMIT = 3
# (parents, branch rank of each node among its siblings); node 0 is the root
SHAPES = {
    "2-2-1": ([-1, 0, 0, 1, 1, 2, 3], [0, 0, 1, 0, 1, 0, 0]),
    "3-wide": ([-1, 0, 0, 0, 1], [0, 0, 1, 2, 0]),
    "chains-K2-L2": ([-1, 0, 0, 1, 2], [0, 0, 1, 0, 0]),
    "sampled-2x2": ([-1, 0, 0, 1, 1, 2, 2], [0, 0, 1, 0, 1, 0, 1]),
}


def tables(seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logits L [V, V], draft law Q [V, V]): row c is the law after token c."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, V, generator=gen, dtype=DTYPE) * 1.6
    draft = torch.softmax(logits / 1.4 + 0.9 * torch.randn(V, V, generator=gen, dtype=DTYPE), dim=-1)
    return logits, draft


def build_trees(shape: str, kind: str, ctx: torch.Tensor, draft: torch.Tensor, gen: torch.Generator,
                duplicate: bool = False) -> TokenTree:
    """One tree per row from the rows' last tokens ``ctx`` [R] (on ctx's device)."""
    parents_l, ranks_l = SHAPES[shape]
    r, n, dev = ctx.shape[0], len(parents_l), ctx.device
    parents = torch.tensor(parents_l, dtype=torch.int64, device=dev).expand(r, n).clone()
    tokens = torch.zeros(r, n, dtype=torch.int64, device=dev)
    tokens[:, 0] = ctx
    order = torch.argsort(draft, dim=-1, descending=True, stable=True)              # top-k of Q per context
    for i in range(1, n):
        par_tok = tokens[:, parents_l[i]]
        if kind == "distinct":
            rank = ranks_l[i]
            tokens[:, i] = order[par_tok, 0 if (duplicate and rank == 1) else rank]
        else:
            tokens[:, i] = torch.multinomial(draft[par_tok], 1, generator=gen).squeeze(1)
    probs = draft[tokens] if kind == "iid" else None
    return TokenTree(parents=parents, tokens=tokens, sizes=torch.full((r,), n, dtype=torch.int64, device=dev),
                     kind=kind, draft_probs=probs)


def _ragged(tree: TokenTree, gen: torch.Generator) -> TokenTree:
    """Cut every row's tree to a random prefix of its nodes (parents < n, so a prefix is a tree)."""
    r, n = tree.parents.shape
    sizes = torch.randint(1, n + 1, (r,), generator=gen, device=gen.device)
    pad = torch.arange(n, device=sizes.device)[None, :] >= sizes[:, None]
    return TokenTree(parents=torch.where(pad, -1, tree.parents), tokens=torch.where(pad, -1, tree.tokens),
                     sizes=sizes, kind=tree.kind, draft_probs=tree.draft_probs)


def tree_case(shape: str, kind: str, scheme: str, sampling: SamplingParams, samples: int, alpha: float, seed: int,
              *, duplicate: bool = False, ragged: bool = False, planted: bool = False,
              sampler: str = "gumbel", device="cpu", static: bool = False) -> CaseResult:
    """The law of the first three emitted tokens (see the module docstring); the sampler runs on ``device``;
    ``static``: iid selection told the shape's depth and width (the engine's path without host syncs)."""
    start = time.perf_counter()
    logits, draft = tables()
    exact_p = torch.exp(log_probs(logits[None].float(), resolve_sampling(sampling, 1, "cpu"))[0].to(DTYPE))
    exact_p = exact_p / exact_p.sum(-1, keepdim=True)
    logits, draft = logits.to(device), draft.to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    ctx = torch.zeros(samples, dtype=torch.int64, device=device)
    out = torch.full((samples, EMIT), -1, dtype=torch.int64, device=device)
    have = torch.zeros(samples, dtype=torch.int64, device=device)
    seeds = seed * (1 << 24) + torch.arange(samples, dtype=torch.int64, device=device)
    rounds = 0
    while bool((have < EMIT).any()):
        rows = (have < EMIT).nonzero().squeeze(1)
        tree = build_trees(shape, kind, ctx[rows], draft, gen, duplicate)
        if ragged:
            tree = _ragged(tree, gen)
        tl = logits[tree.tokens.clamp(min=0)].float()
        if planted:
            sel = select_distinct(tree, tl, None, sampling, seeds[rows], have[rows], sampler, renormalise=False)
        else:
            sel = select_tree(tree, tl, sampling=sampling, scheme=scheme, seed=seeds[rows], offsets=have[rows],
                              sampler=sampler, **(shape_bounds(shape) if static else {}))
        for j in range(sel.output_tokens.shape[1]):
            em = sel.output_tokens[:, j]
            put = (em >= 0) & (have[rows] < EMIT)
            rr = rows[put]
            out[rr, have[rr]] = em[put]
            have[rr] += 1
        ctx[rows] = out[rows, (have[rows] - 1).clamp(min=0)]
        rounds += 1
    counts = torch.bincount((out[:, 0] * V + out[:, 1]) * V + out[:, 2], minlength=V ** EMIT).cpu().numpy()
    law = (exact_p[0][:, None, None] * exact_p[:, :, None] * exact_p[None, :, :]).reshape(-1).numpy()
    fits = {"triple": fit_test(counts, law)}
    name = f"tree-{shape}-{kind}" + ("-dup" if duplicate else "") + ("-ragged" if ragged else "") + \
        ("-static" if static else "") + \
        (f"-T{sampling.temperature}" + (f"-k{sampling.top_k}" if sampling.top_k else "")
         + (f"-p{sampling.top_p}" if sampling.top_p < 1 else ""))
    method = "tree:planted-no-renorm" if planted else f"tree:{scheme if kind == 'iid' else 'rrs'}"
    return summarize(name, method, samples, alpha, fits, time.perf_counter() - start, exact_method=not planted,
                     note=("power check: must FAIL; " if planted else "") +
                          f"V={V}; law of (y1, y2, y3) over {rounds} rounds")


def shape_bounds(shape: str) -> dict:
    """{max_depth, max_width} of a SHAPES tree: its deepest level and its widest level."""
    parents = SHAPES[shape][0]
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    deepest = max(depth)
    return {"max_depth": deepest, "max_width": max(depth.count(d) for d in range(1, deepest + 1))}


def run_tree_exactness(samples: int, alpha: float = 1e-6, seed: int = 0, device="cpu") -> list[CaseResult]:
    """Every tree kind and scheme, filters, ragged trees, repeated siblings, and the planted-bias power check."""
    if samples < 100:
        raise ValueError(f"samples must be >= 100, got {samples}")
    t1, filt = SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=3, top_p=0.95)
    kw = {"device": device}
    cases = [tree_case("2-2-1", "distinct", "rrs", t1, samples, alpha, seed, **kw),
             tree_case("2-2-1", "distinct", "rrs", filt, samples, alpha, seed + 1, sampler="cdf", **kw),
             tree_case("3-wide", "distinct", "rrs", t1, samples, alpha, seed + 2, duplicate=True, ragged=True, **kw)]
    for scheme, shape in (("specinfer", "chains-K2-L2"), ("spectr", "chains-K2-L2"), ("is", "chains-K2-L2"),
                          ("specinfer", "sampled-2x2")):
        cases.append(tree_case(shape, "iid", scheme, t1, samples, alpha, seed + 3, **kw))
    for scheme, shape in (("specinfer", "chains-K2-L2"), ("spectr", "sampled-2x2")):   # the sync-free selection
        cases.append(tree_case(shape, "iid", scheme, filt, samples, alpha, seed + 5, ragged=True, static=True,
                               sampler="cdf", **kw))
    cases.append(tree_case("2-2-1", "distinct", "rrs", t1, samples, alpha, seed + 4, planted=True, **kw))
    return cases


def summary_ok(results: list[CaseResult]) -> bool:
    """True when every exact case passed and every power check failed."""
    return all(r.passed == r.exact_method for r in results)

