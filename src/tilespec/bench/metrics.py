"""Accuracy and efficiency metrics of the evaluation: ROUGE-1, WER, Δ% vs baseline, verify bytes and bandwidth.

* ROUGE-1: F-measure of ``rouge-score``'s ``rouge1`` with its stemmer, averaged over examples (the paper reports
  ROUGE-1 in [0, 1]); with several references the best one counts.
* WER: ``jiwer`` over the whole set (total errors / total reference words) after Whisper's English text normaliser
  (``transformers.models.whisper.english_normalizer.EnglishTextNormalizer``; no British->American spelling map,
  as the cached Whisper folders ship no ``normalizer.json``).
* Paired bootstrap: the metric difference between two methods on the same examples, with a percentile 95 % interval
  from resampling the examples (ROUGE-1: mean of per-example scores; WER: resampled corpus errors / words).
* Δ%: relative reduction vs the baseline, ``100 * (base - x) / base`` (positive = faster), as in the paper's tables.
* verify bytes: the least a verification kernel must read per step, target logits [B, γ+1, V] plus draft logits
  [B, γ, V] in the logits' dtype; realized bandwidth = bytes / verify time (the paper's Table 3 counts DRAM sectors
  with Nsight Compute instead; ours is a lower bound of the traffic).
"""
from __future__ import annotations

import math
import statistics
from typing import Sequence


def rouge1(predictions: Sequence[str], references: Sequence) -> float:
    """Mean ROUGE-1 F1 (stemmed); each reference may be a string or a list of strings (best match counts)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not predictions:
        raise ValueError("ROUGE-1 of an empty set is undefined")
    try:
        from rouge_score import rouge_scorer
    except ImportError as err:
        raise ImportError("ROUGE needs `rouge-score` (pip install rouge-score)") from err
    scorer = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)
    scores = []
    for pred, ref in zip(predictions, references):
        refs = [ref] if isinstance(ref, str) else list(ref)
        scores.append(max(scorer.score(r, pred)["rouge1"].fmeasure for r in refs))
    return float(sum(scores) / len(scores))


ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def rouge_per_example(predictions: Sequence[str], references: Sequence) -> dict:
    """{type: per-example F1} for ROUGE-1 / ROUGE-2 / ROUGE-L (stemmed, best reference counts), in one scoring pass,
    remembered per (predictions, references): the report scores the same outputs for several tables."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    key = (tuple(predictions), tuple(r if isinstance(r, str) else tuple(r) for r in references))
    if key not in _ROUGE_SCORES:
        from rouge_score import rouge_scorer
        scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
        out = {t: [] for t in ROUGE_TYPES}
        for pred, ref in zip(*key):
            scores = [scorer.score(r, pred) for r in ([ref] if isinstance(ref, str) else ref)]
            for t in ROUGE_TYPES:
                out[t].append(max(x[t].fmeasure for x in scores))
        _ROUGE_SCORES[key] = out
    return _ROUGE_SCORES[key]


_ROUGE_SCORES: dict = {}


def bootstrap_ci(metric: str, pieces: list, n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(value, 2.5 %, 97.5 % bootstrap quantiles) of a metric over resampled examples: ``pieces`` are per-example
    scores for ROUGE types (mean) or (word errors, reference words) pairs for WER (corpus ratio)."""
    import random
    if metric not in (*ROUGE_TYPES, "wer"):
        raise ValueError(f"no bootstrap for metric {metric!r}; choose {', '.join(ROUGE_TYPES)} or wer")
    if not pieces:
        raise ValueError("a bootstrap interval needs at least one example")
    rng, n = random.Random(seed), len(pieces)
    vals = sorted(_aggregate(metric, [pieces[rng.randrange(n)] for _ in range(n)]) for _ in range(n_boot))
    return _aggregate(metric, pieces), vals[int(0.025 * (n_boot - 1))], vals[int(0.975 * (n_boot - 1))]


_NORMALIZER = None


def normalize_english(text: str) -> str:
    """Whisper's English text normaliser (lower case, numbers, punctuation, contractions)."""
    global _NORMALIZER
    if _NORMALIZER is None:
        from transformers.models.whisper.english_normalizer import EnglishTextNormalizer
        _NORMALIZER = EnglishTextNormalizer({})
    return _NORMALIZER(text)


def wer(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus WER (jiwer) after Whisper's English normaliser; empty normalised references are dropped."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    import jiwer

    pairs = [(normalize_english(r), normalize_english(h)) for h, r in zip(hypotheses, references)]
    pairs = [(r, h) for r, h in pairs if r.strip()]
    if not pairs:
        raise ValueError("WER needs at least one non-empty reference")
    return float(jiwer.wer([r for r, _ in pairs], [h for _, h in pairs]))


def delta_pct(baseline: float, value: float) -> float:
    """Relative reduction in % (``100 (baseline - value) / baseline``); NaN when the baseline is 0 or missing."""
    if baseline is None or value is None or not baseline or math.isnan(baseline) or math.isnan(value):
        return float("nan")
    return 100.0 * (baseline - value) / baseline


def verify_bytes(gammas: Sequence[int], vocab: int, itemsize: int, batch: float = 1) -> int:
    """Bytes a verify kernel must read over the steps ``gammas``: (γ+1 target + γ draft) logit rows per request."""
    return int(sum((2 * g + 1) * vocab * itemsize * batch for g in gammas if g > 0))


def bandwidth_gbps(nbytes: int, seconds: float) -> float:
    """Realized bandwidth in GB/s (1e9 bytes)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """(mean, sample std) of ``values``; std 0 for one value; NaNs for none."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return float("nan"), float("nan")
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def _per_example(metric: str, texts: Sequence[str], references: Sequence) -> list:
    """Per-example pieces of a corpus metric: ROUGE-1 F1 scores, or (word errors, reference words) for WER."""
    if metric == "rouge1":
        return rouge_per_example(texts, references)["rouge1"]
    if metric == "wer":
        import jiwer
        out = []
        for t, r in zip(texts, references):
            ref, hyp = normalize_english(r), normalize_english(t)
            if not ref.strip():
                continue
            m = jiwer.process_words(ref, hyp)
            out.append((m.substitutions + m.deletions + m.insertions, len(ref.split())))
        return out
    raise ValueError(f"no paired bootstrap for metric {metric!r}")


def _aggregate(metric: str, pieces: list) -> float:
    if metric.startswith("rouge"):
        return sum(pieces) / len(pieces)
    return sum(e for e, _ in pieces) / max(1, sum(w for _, w in pieces))


def paired_bootstrap(metric: str, texts_a: Sequence[str], texts_b: Sequence[str], references: Sequence,
                     n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(metric(b) - metric(a), 2.5 %, 97.5 % bootstrap quantiles) over examples resampled with replacement.

    a and b are two methods' outputs on the same examples (same order as ``references``); an interval that
    contains 0 means the difference is within sampling noise at this sample size.
    """
    import random
    if not (len(texts_a) == len(texts_b) == len(references)) or not references:
        raise ValueError("paired bootstrap needs equally many (>= 1) outputs of both methods and references")
    pa, pb = _per_example(metric, texts_a, references), _per_example(metric, texts_b, references)
    n, rng, diffs = len(pa), random.Random(seed), []
    for _ in range(n_boot):
        idx = [rng.randrange(n) for _ in range(n)]
        diffs.append(_aggregate(metric, [pb[i] for i in idx]) - _aggregate(metric, [pa[i] for i in idx]))
    diffs.sort()
    return (_aggregate(metric, pb) - _aggregate(metric, pa), diffs[int(0.025 * (n_boot - 1))],
            diffs[int(0.975 * (n_boot - 1))])
