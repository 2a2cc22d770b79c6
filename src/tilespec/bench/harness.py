"""The evaluation loop: decode the same examples with each verification method and aggregate what was measured.

Protocol (the seed paper's, §4.1): batch size 1, the transformers γ heuristic (start 5, +2 when a whole draft is
accepted, else -1), seeds ``seed + i`` for example i under every method, and an uncounted warm-up per method (see
:mod:`.warmup`) that visits every draft length K the schedule can reach, so that no Triton compilation, CUDA-graph
capture or other first-call cost lands inside a timed region. Per method we keep the texts, the accuracy metric,
the time inside ``verify()`` (CUDA events on GPU, perf_counter on CPU; the engine's RunStats), the wall clock of
the whole decoding loop, acceptance, peak memory and the bytes the verification must read; Δ% columns compare each
method with the ``hf`` baseline. Settings live in :mod:`.config`, the aggregation of a run in :mod:`.aggregate`.

Batched mode (``cfg.batch_size`` = N > 1, :func:`run_main` only; not the paper's protocol): consecutive chunks of
N examples are decoded together through the engine's ragged batch, example i still with seed ``seed + i``, so the
exact methods' T = 1 draws stay keyed per example (the same law as at batch 1; ``hf`` draws the batch from one
generator, so its T = 1 tokens depend on the batch, its law does not). At T = 0 the outputs equal batch 1's up to
float ties (left padding changes the reduction shapes). The γ heuristic is then shared by the N rows of a chunk
(+2 only when every row accepted its whole draft), and the times are per batched step: Δ% profiling compares
methods at the same N, but timings at N > 1 are not the paper's batch-1 numbers.

Resumable runs: :func:`run_main` keeps raw per-chunk records (:mod:`.chunks`) and calls ``on_chunk`` after every
chunk; given the records of an earlier, cut-off invocation (``resume``) it decodes only the examples a method has
not done yet and appends.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from .aggregate import add_deltas, summarize
from .chunks import MethodRun, chunk_record, common_examples, restore_run
from .config import EvalConfig, engine_compile, method_options
from .warmup import batch_inputs, harness_schedule, harness_verify, warm_up


def make_decoder(target, draft, method: str, cfg: EvalConfig, *, gamma: Optional[int] = None,
                 schedule: Optional[str] = None):
    """The :class:`SpeculativeDecoder` of one (method, γ, schedule) setting of ``cfg``."""
    from tilespec.engine import SpeculativeDecoder
    from tilespec.verify.types import SamplingParams

    gamma = gamma or cfg.gamma
    device = next(target.parameters()).device
    return SpeculativeDecoder(target, draft, gamma=gamma, gamma_schedule=schedule or cfg.schedule,
                              max_gamma=max(cfg.max_gamma, gamma), method=method,
                              sampling=SamplingParams(temperature=cfg.temperature),
                              compile=engine_compile(cfg, device), schedule=harness_schedule,
                              verify_fn=harness_verify, method_options=method_options(method, cfg),
                              graph_verify=False)  # every method's verify timed eagerly, like the hf baseline


def decode_all(target, draft, task, prepared: list, method: str, cfg: EvalConfig, *, gamma: Optional[int] = None,
               schedule: Optional[str] = None, max_new_tokens: Optional[int] = None, warmup: bool = True) -> MethodRun:
    """Decode every prepared input (batch 1, seed ``cfg.seed + i``) with ``method``; uncounted warm-up first."""
    gamma = gamma or cfg.gamma
    schedule = schedule or cfg.schedule
    dec = make_decoder(target, draft, method, cfg, gamma=gamma, schedule=schedule)
    limit = max_new_tokens or cfg.max_new_tokens
    run = MethodRun(method=method)
    if warmup and prepared:
        run.warmup = warm_up(dec, prepared, method, cfg, gamma=gamma, schedule=schedule, limit=limit)
    for i, p in enumerate(prepared):
        _generate_into(run, dec, task, p, cfg.seed + i, limit)
    return run


def _generate_into(run: MethodRun, dec, task, p, seed: int, limit: int) -> None:
    out = dec.generate(input_ids=[p.ids], max_new_tokens=limit, seed=seed, input_features=p.features)
    run.sequences.append(list(out.sequences[0]))
    run.texts.append(task.decode(out.sequences[0]))
    run.stats.append(out.stats)


def run_main(target, draft, task, examples: list, cfg: EvalConfig, log=print,
             deadline: Optional[float] = None, raw: Optional[dict] = None,
             on_chunk: Optional[Callable] = None) -> dict:
    """The main comparison (paper Tables 1, 5, 6): every method on every example with the heuristic γ.

    Every method is warmed up first (at the chunk shapes it will decode); then the examples are decoded chunk-major
    (chunk c of ``cfg.batch_size`` consecutive examples with every method, then chunk c + 1), so that a ``deadline``
    (time.time() value) cuts all methods at the same example count: after the deadline no new chunk is started (at
    least one is always done). ``raw`` = {method: [chunk records]} (in/out): the records of earlier invocations of
    the same run, appended to in place; examples already done by a method are skipped for it. ``on_chunk(raw, rows_fn)`` is called after every chunk
    with the raw records {method: [chunk records]} so far and a function computing the summary rows from them.
    Returns the rows {method: summary} over the examples every method has done (each row's ``examples``)."""
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    prepared = [task.prepare(e, device, dtype) for e in examples]
    bs = cfg.batch_size
    raw = raw if raw is not None else {}
    for m in cfg.methods:
        raw.setdefault(m, [])
    done = {m: {i for c in raw[m] for i in c["idx"]} for m in cfg.methods}
    todo = [i for i in range(len(examples)) if any(i not in done[m] for m in cfg.methods)]
    chunks = [todo[j:j + bs] for j in range(0, len(todo), bs)]
    warm = {}
    if todo:
        decs = {m: make_decoder(target, draft, m, cfg) for m in cfg.methods}
        for m in cfg.methods:
            if cfg.warmup:
                warm[m] = warm_up(decs[m], [prepared[i] for i in todo], m, cfg, gamma=cfg.gamma,
                                  schedule=cfg.schedule, limit=cfg.max_new_tokens, batch_size=bs)
        log(f"  [{time.strftime('%H:%M:%S')}] warm-up done ({', '.join(cfg.methods)}); {len(todo)} of "
            f"{len(examples)} examples to decode in {len(chunks)} chunk(s) of <= {bs}")

    def rows_fn(final: bool = False) -> dict:
        return summarize_chunks(raw, target, task, examples, cfg.methods, warm, log if final else None)

    for c, chunk in enumerate(chunks):
        if c > 0 and deadline is not None and time.time() > deadline:
            log(f"  time budget reached: {len(chunks) - c} chunk(s) left; run the same command again to resume")
            break
        for m in cfg.methods:
            sub = [i for i in chunk if i not in done[m]]
            if sub:
                raw[m].append(decode_chunk(decs[m], task, [prepared[i] for i in sub], sub,
                                           [cfg.seed + i for i in sub], cfg.max_new_tokens))
                done[m].update(sub)
        log(f"  [{time.strftime('%H:%M:%S')}] chunk {c + 1}/{len(chunks)}: "
            f"{min(len(d) for d in done.values())}/{len(examples)} examples")
        if on_chunk is not None:
            on_chunk(raw, rows_fn)
    return rows_fn(final=True)


def decode_chunk(dec, task, chunk: list, idx: list, seeds: list, limit: int) -> dict:
    """Decode the Prepared inputs ``chunk`` (examples ``idx``) as one batch with per-request ``seeds``; returns
    its chunk record (:func:`.chunks.chunk_record`)."""
    ids, feats = batch_inputs(chunk)
    out = dec.generate(input_ids=ids, max_new_tokens=limit, seed=list(seeds), input_features=feats)
    return chunk_record(idx, seeds, out.sequences, [task.decode(s) for s in out.sequences], out.stats)


def summarize_chunks(raw: dict, target, task, examples: list, methods, warm: Optional[dict] = None,
                     log=None) -> dict:
    """Summary rows {method: row} over the examples every method has done (in example order), Δ% vs hf added;
    timing aggregates pool the chunks made only of those examples (``timed_examples`` says how many)."""
    common = common_examples(raw, methods)
    rows, seqs = {}, {}
    if not common:
        return rows
    for m in methods:
        run, timed = restore_run(m, raw[m], common)
        rows[m] = summarize(run, target, task=task, examples=[examples[i] for i in common])
        rows[m].update(timed_examples=timed, warmup=(warm or {}).get(m, {}))
        seqs[m] = run.sequences
        r = rows[m]
        if log is not None:
            log(f"  {m:8s} {task.metric}={r[task.metric]:.4f} verify={r['verify_time_s']:.3f}s "
                f"({r['verify_step_ms']:.3f} ms/step) wall={r['wall_time_s']:.2f}s alpha={r['alpha']:.3f} "
                f"{r['tokens_per_s']:.0f} tok/s")
    add_deltas(rows, sequences=seqs)
    return rows
