"""The statistical exactness suite: sample a method many times and test its output law against the exact one.

For every case and every draft length K_b in it the suite runs three families of G / chi-square tests:
  * ``final``: the law of (number accepted N, last emitted token y_N)   -- (K_b + 1) * V categories;
  * ``pos j``: at each position j, (accepted x | rejected and emitted y | not reached) -- 2V + 1 categories;
  * ``sequence``: the joint law of the whole emitted sequence y_0..y_N (rare sequences pooled).
A method passes a case when every p-value is >= alpha. The power check runs a sampler with 1 % of its mass moved
(:func:`biased_reference`) on :func:`cases.power_cases`; if the suite does not catch it, the suite is too weak.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from ..verify import rng, verify
from ..verify.api import VerifyResult
from ..verify.registry import get_method
from ..verify.validation import resolve_sampling
from .cases import Case, default_cases, power_cases
from .law import StepLaw, step_law
from .stats import CaseResult, FitResult, fit_test, summarize

Sampler = Callable[..., VerifyResult]


def method_sampler(name: str) -> Sampler:
    return functools.partial(verify, method=name)


def biased_reference(*args, **kwargs) -> VerifyResult:
    """The power check's planted bug: reference sampling, then 1 % of requests emit the next vocabulary id instead."""
    result = verify(*args, method="reference", **kwargs)
    seeds = kwargs["seed"]
    vocab = args[0].shape[-1]
    u = rng.uniform(seeds, torch.zeros_like(seeds), rng.PURPOSE_EXTRA, 7)
    rows = torch.arange(len(seeds))
    last = result.output_tokens[rows, result.num_accepted]
    moved = torch.where(u < 0.01, (last + 1) % vocab, last)
    result.output_tokens[rows, result.num_accepted] = moved
    return result


def _one_stream(method: str) -> bool:
    """True for a registered method that draws the whole batch from one generator (``hf``): it is given one seed
    for the whole chunk (repeated per request) instead of per-request seeds."""
    try:
        return not get_method(method).batch_invariant
    except ValueError:   # a test sampler such as the power check's, not a registered method
        return False


def _draw_drafts(case: Case, laws_q: torch.Tensor | None, count: int, gen: torch.Generator) -> torch.Tensor:
    """[count, K] draft tokens: sampled from the processed draft law q [K, V], or the fixed one-hot tokens."""
    k = case.max_draft
    if laws_q is None or k == 0:
        fixed = case.draft_tokens if case.draft_tokens is not None else torch.zeros(k, dtype=torch.long)
        return fixed[None, :].expand(count, k).clone()
    cols = [torch.multinomial(laws_q[j], count, replacement=True, generator=gen) for j in range(k)]
    return torch.stack(cols, dim=1)


def _encode(tokens: np.ndarray, emitted: np.ndarray, vocab: int) -> np.ndarray:
    """Encode each emitted sequence (row of tokens, first `emitted` entries) as one int64."""
    code = np.zeros(len(tokens), dtype=np.int64)
    for j in range(tokens.shape[1]):
        live = j < emitted
        code = np.where(live, code * (vocab + 1) + tokens[:, j] + 1, code)
    return code


def _encode_one(seq: tuple, vocab: int) -> int:
    """The code :func:`_encode` gives one sequence."""
    code = 0
    for token in seq:
        code = code * (vocab + 1) + token + 1
    return code


def _fits_for_kind(law: StepLaw, tokens: np.ndarray, num_acc: np.ndarray) -> dict[str, FitResult]:
    """All tests for the requests of one draft length. tokens [n, K+1] (-1 padded), num_acc [n]."""
    n, vocab, k_b = len(tokens), law.vocab, law.num_draft
    rows = np.arange(n)
    last = tokens[rows, num_acc]
    fits = {"final": fit_test(np.bincount(num_acc * vocab + last, minlength=(k_b + 1) * vocab), law.final_law())}
    for j in range(k_b + 1):
        yj = tokens[:, j]
        if j == k_b:
            cat = np.where(num_acc == j, yj, vocab)
        else:
            cat = np.where(num_acc > j, yj, np.where(num_acc == j, vocab + yj, 2 * vocab))
        size = vocab + 1 if j == k_b else 2 * vocab + 1
        fits[f"pos {j}"] = fit_test(np.bincount(cat, minlength=size), law.position_law(j))
    seq_law = law.sequence_law(min_prob=5.0 / n)
    keys = np.array([_encode_one(s, vocab) for s in seq_law], dtype=np.int64)
    codes = _encode(np.where(tokens < 0, 0, tokens), num_acc + 1, vocab)
    uniq, counts = np.unique(codes, return_counts=True)
    observed = dict(zip(uniq.tolist(), counts.tolist()))
    listed = np.array([observed.get(int(c), 0) for c in keys], dtype=np.float64)
    probs = np.array(list(seq_law.values()), dtype=np.float64)
    fits["sequence"] = fit_test(np.append(listed, n - listed.sum()), np.append(probs, max(0.0, 1 - probs.sum())))
    return fits


def run_case(case: Case, sampler: Sampler, method: str, samples: int, alpha: float = 1e-6, seed: int = 0,
             chunk: int = 50_000, device: str = "cpu", exact_method: bool = True) -> CaseResult:
    """Draw `samples` requests of `case` through `sampler`, test every draft length's law. Returns a CaseResult."""
    start = time.perf_counter()
    resolved = resolve_sampling(case.sampling, 1, "cpu")
    vocab = case.target_logits.shape[-1]
    k = case.max_draft
    tl = case.target_logits[None]
    dl = case.draft_logits[None] if case.draft_logits is not None else None
    dp = case.draft_probs[None] if case.draft_probs is not None else None
    fixed = (case.draft_tokens if case.draft_tokens is not None else torch.zeros(k, dtype=torch.long))[None]
    laws = {k_b: step_law(tl.float(), dl, dp, fixed, k_b, resolved) for k_b in case.lengths}
    q = None
    if dl is not None or dp is not None:
        from ..verify.distributions import draft_log_probs
        q = draft_log_probs(fixed, vocab, resolved, dl, dp)[0].double().exp()
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(case.lengths)
    one_stream = _one_stream(method)
    collected_tokens, collected_acc, collected_kind = [], [], []
    done = 0
    while done < samples:
        m = min(chunk, samples - done)
        kinds = lengths[torch.arange(done, done + m) % len(lengths)]
        seeds = torch.arange(done, done + m, dtype=torch.int64) + seed * 1_000_000_007
        kwargs = dict(
            draft_logits=None if dl is None else dl.expand(m, -1, -1).contiguous().to(device),
            draft_probs=None if dp is None else dp.expand(m, -1, -1).contiguous().to(device),
            num_draft_tokens=None if case.single_request else kinds.to(device),
            sampling=case.sampling, seed=(seeds[:1].expand(m) if one_stream else seeds).to(device),
            check_values=(done == 0))
        result = sampler(tl.expand(m, -1, -1).contiguous().to(device), _draw_drafts(case, q, m, gen).to(device),
                         **kwargs)
        collected_tokens.append(result.output_tokens.cpu().numpy())
        collected_acc.append(result.num_accepted.cpu().numpy())
        collected_kind.append(kinds.numpy())
        done += m
    tokens, num_acc, kind = (np.concatenate(x) for x in (collected_tokens, collected_acc, collected_kind))
    fits: dict[str, FitResult] = {}
    for k_b, law in laws.items():
        sel = kind == k_b
        for name, fit in _fits_for_kind(law, tokens[sel], num_acc[sel]).items():
            fits[f"K_b={k_b} {name}"] = fit
    return summarize(case.name, method, samples, alpha, fits, time.perf_counter() - start, exact_method)


def check_determinism(method: str, device: str = "cpu", seed: int = 0) -> CaseResult:
    """Same seeds -> same tokens, whatever the batch order or the other requests in the batch."""
    start = time.perf_counter()
    g = torch.Generator().manual_seed(seed)
    batch, k, vocab = 24, 4, 40
    target = torch.randn(batch, k + 1, vocab, generator=g).to(device)
    draft = torch.randn(batch, k, vocab, generator=g).to(device)
    tokens = torch.randint(0, vocab, (batch, k), generator=g).to(device)
    lengths = torch.randint(0, k + 1, (batch,), generator=g).to(device)
    seeds = torch.randint(0, 2**40, (batch,), generator=g).to(device)
    offsets = torch.randint(0, 1000, (batch,), generator=g).to(device)

    def run(idx: torch.Tensor) -> torch.Tensor:
        r = verify(target[idx], tokens[idx], draft_logits=draft[idx], num_draft_tokens=lengths[idx], seed=seeds[idx],
                   offsets=offsets[idx], method=method)
        return r.output_tokens

    base = run(torch.arange(batch))
    again = run(torch.arange(batch))
    perm = torch.randperm(batch, generator=g)
    permuted = run(perm.to(device))
    half = torch.arange(batch // 2)
    ok = (torch.equal(base, again) and torch.equal(base[perm.to(device)], permuted)
          and torch.equal(base[: batch // 2], run(half.to(device))))
    return CaseResult(case="determinism (rerun, permuted batch, sub-batch)", method=method, samples=batch,
                      alpha=0.0, passed=ok, seconds=time.perf_counter() - start,
                      note="" if ok else "outputs changed with batch order or composition")


def run_suite(methods: Iterable[str] = ("reference",), samples: int = 1_000_000, alpha: float = 1e-6,
              seed: int = 0, device: str = "cpu", cases: Optional[list[Case]] = None,
              name_filter: Optional[str] = None, power_check: bool = True,
              on_result: Optional[Callable[[CaseResult], None]] = None) -> list[CaseResult]:
    """Run every case for every exact method (plus determinism and the power check). Returns all CaseResults.

    Cases a method does not support (NotImplementedError) are reported as skipped (passed, with a note).
    The `hf` baseline runs only single-request cases and has no determinism guarantee across batches.
    """
    results: list[CaseResult] = []
    all_cases = cases if cases is not None else default_cases(seed)
    if name_filter:
        all_cases = [c for c in all_cases if name_filter in c.name]

    def emit(r: CaseResult) -> None:
        results.append(r)
        if on_result:
            on_result(r)

    for method in methods:
        exact = get_method(method).exact
        for case in all_cases:
            if method == "hf" and not case.single_request:
                continue
            try:
                emit(run_case(case, method_sampler(method), method, samples, alpha, seed, device=device,
                              exact_method=exact))
            except NotImplementedError as err:
                emit(CaseResult(case=case.name, method=method, samples=0, alpha=alpha, passed=True,
                                exact_method=exact, note=f"skipped: {err}"))
        if method != "hf":
            emit(check_determinism(method, device, seed))
    if power_check:
        for case in power_cases(seed):
            r = run_case(case, biased_reference, "biased(1% moved)", samples, alpha, seed, device=device,
                         exact_method=False)
            r.note = "power check: must FAIL"
            r.passed = not r.passed   # for the planted bug, being caught is the pass condition
            emit(r)
    return results
