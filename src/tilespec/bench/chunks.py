"""Per-method results (:class:`MethodRun`) and raw per-chunk records of the main comparison: what a resumed run
reads back and what a report can re-check.

A chunk record (JSON-safe) is one batched generation of one method::

    {"idx": [i, ...],            # example indices (positions in the run's ``ids``), in batch-row order
     "seeds": [seed + i, ...],   # per-request seeds of those rows
     "sequences": ["t1 t2 ...", ...],   # new token ids per row, space-separated (compact in an indent=1 JSON)
     "texts": [str, ...],        # decoded texts per row
     "stats": {...}}             # dataclasses.asdict(RunStats) of the generation (all rows together)

Invariants: within one method an example index appears in at most one chunk; a run's records are only resumed
by the same configuration (quality.py checks the config and the example ids).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class MethodRun:
    """Raw per-example results of decoding a list of inputs with one method and one γ setting."""

    method: str
    sequences: list = field(default_factory=list)
    texts: list = field(default_factory=list)
    stats: list = field(default_factory=list)
    warmup: dict = field(default_factory=dict)


def chunk_record(idx: list, seeds: list, sequences: list, texts: list, stats) -> dict:
    """The record of one batched generation (see the module docstring); ``stats`` a RunStats."""
    if not (len(idx) == len(seeds) == len(sequences) == len(texts)):
        raise ValueError(f"chunk rows disagree: {len(idx)} idx, {len(seeds)} seeds, {len(sequences)} sequences, "
                         f"{len(texts)} texts")
    return dict(idx=[int(i) for i in idx], seeds=[int(s) for s in seeds],
                sequences=[" ".join(str(int(t)) for t in seq) for seq in sequences], texts=list(texts),
                stats=asdict(stats))


def stats_from_dict(d: dict):
    """A RunStats from ``asdict`` output (unknown keys, e.g. from a newer engine, are ignored)."""
    from tilespec.engine import RunStats

    names = {f.name for f in fields(RunStats)}
    return RunStats(**{k: v for k, v in d.items() if k in names})


def done_examples(records: list) -> set:
    return {i for c in records for i in c["idx"]}


def common_examples(raw: dict, methods) -> list:
    """Sorted example indices that every method in ``methods`` has decoded."""
    sets = [done_examples(raw.get(m, [])) for m in methods]
    return sorted(set.intersection(*sets)) if sets else []


def restore_run(method: str, records: list, common: list):
    """(MethodRun over the examples ``common`` in order, examples timed): texts and sequences of those examples,
    and the stats of every chunk made only of them (a chunk with other examples is left out of the timings)."""
    keep = set(common)
    text, seq = {}, {}
    run = MethodRun(method=method)
    timed = 0
    for c in records:
        for i, s, t in zip(c["idx"], c["sequences"], c["texts"]):
            text[i], seq[i] = t, [int(x) for x in s.split()]
        if set(c["idx"]) <= keep:
            run.stats.append(stats_from_dict(c["stats"]))
            timed += len(c["idx"])
    run.texts = [text[i] for i in common]
    run.sequences = [seq[i] for i in common]
    return run, timed
