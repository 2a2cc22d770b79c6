"""``tilespec draft train --target <a Whisper model>``: :func:`train_whisper_draft` trains and saves a distilled draft.

Recipe (Distil-Whisper's, at the scale of minutes): the target's encoder kept and shared, a decoder of copies of the
target's decoder layers (default: the first and the last), pseudo-labels = the target's own transcripts of the
training speech, loss KL(p_target || p_draft) per transcript position, the target's full distribution as teacher
(whisper_draft.py).

Pseudo-labels (``sample_temperatures``, ``samples_per_clip``; CLI ``--sample-temperatures``, ``--samples-per-clip``):
per clip the greedy transcript (temperature 0) and ``samples_per_clip`` transcripts sampled at each temperature > 0.
Default: 0 and 1 with 4 samples. A draft trained on greedy transcripts only sees the positions greedy decoding visits;
at T = 1 the target's sampled continuations leave them (a 2-layer whisper-base draft with held-out greedy α 0.84
accepted ~0.2 at T = 1), so most training sequences are T = 1 samples, and the greedy one keeps T = 0's positions
covered (sampled transcripts of a confident ASR model mostly follow the greedy one anyway). Several samples per clip
cost little more than one: a decode batch runs until its longest row ends, and the rows decode together. Use
``(0,)`` for the greedy-only recipe.

Training speech (:func:`training_speech`), never the evaluation clips:
  * LJSpeech clips LJ001-0017 .. LJ001-0032 (``tilespec.datasets.ljspeech_split``; LJ001-0001 .. 0016 are the
    evaluation clips and are dropped from any folder given);
  * synthetic speech: set folders written by ``python -m bench.synth --text documents`` (sentences of XSum
    *articles* spoken by espeak-ng; the synthetic evaluation set speaks XSum *summaries*), by default
    ``$TILESPEC_HOME/data/synth-train``; clips whose transcript is also in the synthetic evaluation set
    (``$TILESPEC_SYNTH_DIR``) are dropped.
A share of the training clips (``heldout``, chosen with ``seed``) is held out for the acceptance estimate: α at T = 0
(greedy agreement along their greedy transcripts) and at T = 1 (E Σ min(p, q) along their sampled transcripts; every
training temperature likewise; whisper_acceptance.py), in the report (``held_out``, ``held_out_alpha``) and the
saved draft's manifest. Held-out transcripts at 0 and 1 are decoded for the held-out clips when training used
neither.

Budget (``minutes``): speech loading, features, pseudo-labels and encoder states first, then training until the
budget less a reserve for the held-out estimate and saving. Resumable: ``out/train-state.pt`` holds the clip ids, the
pseudo-labels, the draft's weights, the optimiser and the step; a rerun with the same folder and speech continues.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from tilespec.heads.distilled import draft_dir, save_distilled
from tilespec.heads.store import target_identity
from tilespec.models.distilled import load_own_state, own_state, student, trainable

from .whisper_acceptance import heldout_acceptance
from .whisper_draft import agreement, distill, encoder_states, pseudo_labels

STATE = "train-state.pt"
DEFAULT_SYNTH = "synth-train"
SAMPLE_TEMPERATURES = (0.0, 1.0)
SAMPLES_PER_CLIP = 4
EVAL_TEMPERATURES = (0.0, 1.0)


def check_labels(temperatures, samples_per_clip) -> tuple:
    """``temperatures`` (numbers >= 0, no repeats, at least one) and ``samples_per_clip`` (an integer >= 1) checked;
    returns the temperatures as a sorted tuple of floats. Bad values raise ValueError naming them."""
    try:
        temps = [float(t) for t in temperatures]
    except (TypeError, ValueError):
        raise ValueError(f"sample temperatures must be numbers, got {temperatures!r}") from None
    if not temps:
        raise ValueError("give at least one sample temperature (0: greedy transcripts, e.g. 0,1)")
    bad = [t for t in temps if not (math.isfinite(t) and t >= 0.0)]
    if bad:
        raise ValueError(f"sample temperatures must be finite and >= 0, got {bad}")
    if len(set(temps)) != len(temps):
        raise ValueError(f"sample temperatures repeat: {temps}")
    if isinstance(samples_per_clip, bool) or not isinstance(samples_per_clip, int) or samples_per_clip < 1:
        raise ValueError(f"samples_per_clip must be an integer >= 1, got {samples_per_clip!r}")
    return tuple(sorted(temps))


def _seeds(seed: int, temperature: float, clips: Sequence[int], samples: int) -> list:
    """Request seeds of the pseudo-labels of ``clips`` (indices into the training clips) at ``temperature``: clip c's
    sample s gets one seed fixed by (``seed``, temperature, c, s), so a held-out clip's transcripts are the same
    whether training decoded them or the held-out estimate did (the estimate is comparable across recipes)."""
    base = (seed * 100_003 + int(round(temperature * 1000))) * 10 ** 7
    return [(base + c * samples + s) % 2 ** 62 for c in clips for s in range(samples)]


def _tkey(t: float) -> str:
    return f"{t:g}"


def _normal(text: str) -> str:
    return " ".join(str(text).lower().split())


def evaluation_exclusions() -> tuple[set, set]:
    """(resolved LJSpeech evaluation clip paths, normalised transcripts of the synthetic evaluation set)."""
    from tilespec.datasets import ljspeech_split, synthetic_dir
    import json
    lj = set()
    try:
        lj = {p.resolve() for p in ljspeech_split()[0]}
    except OSError:
        pass
    texts = set()
    found = synthetic_dir()
    if found is not None and (Path(found) / "manifest.jsonl").is_file():
        for line in (Path(found) / "manifest.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                texts.add(_normal(json.loads(line).get("transcript", "")))
    return lj, texts


def default_sources() -> list:
    """The LJSpeech training clips (as paths) and ``$TILESPEC_HOME/data/synth-train`` when it holds a set."""
    from tilespec.datasets import ljspeech_split
    from tilespec.env import tilespec_home
    out = []
    try:
        out += ljspeech_split()[1]
    except OSError:
        pass
    synth = tilespec_home() / "data" / DEFAULT_SYNTH
    if (synth / "manifest.jsonl").is_file():
        out.append(synth)
    return out


def training_speech(sources: Optional[Sequence] = None, log=print) -> tuple[list, dict]:
    """``[{id, audio (16 kHz float32)}]`` and a description of where they come from. ``sources``: audio files,
    folders of audio files, or synthetic set folders (``manifest.jsonl``); default :func:`default_sources`.
    Evaluation clips are dropped (see the module docstring); an empty result is an error naming the fix."""
    from tilespec.datasets import load_manifest
    from tilespec.models.whisper import load_audio
    sources = list(sources) if sources else default_sources()
    lj_eval, synth_eval = evaluation_exclusions()
    rows, described, files = [], [], []
    for src in map(Path, sources):
        if src.is_dir() and (src / "manifest.jsonl").is_file():
            kept = [r for r in load_manifest(src) if _normal(r["reference"]) not in synth_eval]
            total = sum(1 for line in (src / "manifest.jsonl").read_text().splitlines() if line.strip())
            rows += [{"id": f"{src.name}/{r['id']}", "audio": r["audio"]} for r in kept]
            described.append({"source": str(src), "kind": "synthetic set", "clips": len(kept),
                              "dropped_as_evaluation": total - len(kept)})
        elif src.is_dir():
            files += sorted(p for p in src.iterdir() if p.suffix in (".flac", ".wav"))
        elif src.is_file():
            files.append(src)
        else:
            raise FileNotFoundError(f"training speech {src} does not exist")
    if files:
        kept = [p for p in files if p.resolve() not in lj_eval]
        rows += [{"id": p.name, "audio": load_audio(p)} for p in kept]
        described.append({"source": "audio files", "clips": len(kept), "files": [p.name for p in kept],
                          "dropped_as_evaluation": len(files) - len(kept)})
    if not rows:
        raise FileNotFoundError("no training speech: give --speech DIR (audio files or a set from `python -m "
                                "bench.synth --text documents --out DIR`), or put LJSpeech in $TILESPEC_DATA "
                                f"and/or a synthetic set in $TILESPEC_HOME/data/{DEFAULT_SYNTH}")
    seconds = sum(len(r["audio"]) for r in rows) / 16000
    if log:
        log(f"training speech: {len(rows)} clips, {seconds / 60:.1f} min of audio")
    return rows, {"sources": described, "clips": len(rows), "audio_seconds": round(seconds, 1),
                  "evaluation_excluded": "LJSpeech LJ001-0001..0016; transcripts of the synthetic evaluation set"}


def _features(processor, audios, device) -> torch.Tensor:
    extractor = getattr(processor, "feature_extractor", processor)
    try:
        feats = extractor(list(audios), sampling_rate=16000, return_tensors="pt", device=str(device)).input_features
    except TypeError:       # an extractor without the device option
        feats = extractor(list(audios), sampling_rate=16000, return_tensors="pt").input_features
    return feats.to(device=device, dtype=torch.float32)


def train_whisper_draft(target, processor, *, target_name: str, minutes: float = 8.0, out=None, speech=None,
                        layers: Optional[Sequence[int]] = None, max_new_tokens: int = 128, label_batch: int = 32,
                        batch: int = 32, lr: float = 3e-4, warmup: int = 50, max_steps: Optional[int] = None,
                        heldout: float = 0.05, resume: bool = True, compile=False, seed: int = 0, language: str = "en",
                        log=print, prefix: Optional[list] = None, data_share: float = 0.4,
                        sample_temperatures: Sequence[float] = SAMPLE_TEMPERATURES,
                        samples_per_clip: int = SAMPLES_PER_CLIP) -> tuple:
    """Train a distilled draft for the float32 Whisper ``target`` and save it (``out``, default
    ``$TILESPEC_HOME/drafts/<target_name>/``). ``speech``: sources for :func:`training_speech` (or a ready list of
    ``{id, audio}``); ``prefix``: the decoder prompt (default: transcription in ``language``, no timestamps);
    ``data_share``: pseudo-labelling stops after that share of the budget (the clips left are not used);
    ``sample_temperatures`` / ``samples_per_clip``: the pseudo-labels (module docstring); ``label_batch``: clips per
    decode batch (it decodes ``label_batch * samples_per_clip`` rows at a temperature > 0).
    Returns (draft, report); the report is also the manifest's body."""
    from tilespec.models.whisper import decoder_prompt
    temps = check_labels(sample_temperatures, samples_per_clip)
    labels = {"temperatures": list(temps), "samples_per_clip": samples_per_clip}
    t_start = time.perf_counter()
    budget = 60.0 * minutes
    param = next(target.parameters())
    if param.dtype != torch.float32:
        raise ValueError(f"train the draft on a float32 target (got {param.dtype}; CUDA runs it under bf16 autocast)")
    dev = param.device
    folder = Path(out) if out is not None else draft_dir(target_name)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if isinstance(speech, list) and speech and isinstance(speech[0], dict):
        rows, data = speech, {"sources": [{"source": "given", "clips": len(speech)}], "clips": len(speech)}
    else:
        rows, data = training_speech(speech, log=log)
    ids = [r["id"] for r in rows]
    saved = torch.load(folder / STATE, map_location="cpu", weights_only=False) \
        if resume and (folder / STATE).is_file() else None
    if saved is not None and saved["ids"] != ids[:len(saved["ids"])]:
        log(f"{folder / STATE} was made from other speech: starting afresh")
        saved = None
    elif saved is not None and saved.get("labels", {"temperatures": [0.0], "samples_per_clip": 1}) != labels:
        log(f"{folder / STATE} was made from other pseudo-labels ({saved.get('labels', 'greedy only')}): "
            f"starting afresh")
        saved = None
    elif saved is not None:          # the clips the saved pseudo-labels cover
        rows, ids = rows[:len(saved["ids"])], saved["ids"]
    prefix = list(prefix) if prefix is not None else decoder_prompt(target, processor, language)
    t_data = time.perf_counter()
    seqs, owners, seq_temps, states = [], [], [], []
    for i in range(0, len(rows), label_batch):
        if saved is None and i and time.perf_counter() - t_start > data_share * budget:
            log(f"pseudo-labels: {data_share:.0%} of the budget spent, training on {i} of {len(rows)} clips")
            rows, ids = rows[:i], ids[:i]
            data["clips_used"] = i
            break
        feats = _features(processor, [r["audio"] for r in rows[i:i + label_batch]], dev)
        if saved is None:
            new = _label(target, feats, prefix, max_new_tokens, temps, samples_per_clip, label_batch, compile,
                         seed, first=i)
            seqs += new[0]
            owners += new[1]
            seq_temps += new[2]
        states.append(encoder_states(target, feats, batch_size=label_batch))
    states = torch.cat(states)
    if saved is not None:
        seqs = saved["sequences"]
        owners = saved.get("owners", list(range(len(seqs))))
        seq_temps = saved.get("temperatures", [0.0] * len(seqs))
        log(f"resuming from {folder / STATE}: step {saved['step']}")
    data_s = time.perf_counter() - t_data
    n = len(rows)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_held = max(1, int(round(heldout * n))) if n > 1 else 0
    held, train = sorted(perm[:n_held]), sorted(perm[n_held:]) or sorted(perm)
    tokens = sum(len(s) - len(prefix) for s in seqs)
    log(f"pseudo-labels: {len(seqs)} transcripts, {tokens} tokens from {n} clips in {data_s:.1f} s; "
        f"{len(train)} train / {n_held} held out")
    in_train = set(train)
    train_seqs = [j for j in range(len(seqs)) if owners[j] in in_train]
    draft = student(target, layers)
    if saved is not None:
        load_own_state(draft, saved["draft"])
    start = saved["step"] if saved is not None else 0
    steps = max_steps if max_steps is not None else 10 ** 9
    reserve = min(30.0, 0.1 * budget)
    seconds = max(0.0, budget - reserve - (time.perf_counter() - t_start))
    log(f"training {'until step ' + str(steps) if max_steps else f'for {seconds:.0f} s'} (batch {batch}, lr {lr})")
    t_train, kept = time.perf_counter(), []
    losses = distill(target, draft, states, [seqs[j] for j in train_seqs], owners=[owners[j] for j in train_seqs],
                     prefix_len=len(prefix), steps=steps,
                     lr=lr, batch_size=batch, warmup=warmup, seed=seed, seconds=seconds if max_steps is None else None,
                     start_step=start, optimizer_state=saved["opt"] if saved is not None else None,
                     keep_optimizer=kept,
                     log=lambda s, v: log(f"step {s} KL {v:.4f}") if s % 200 == 0 else None)
    train_s = time.perf_counter() - t_train
    step = start + len(losses)
    torch.save({"ids": ids, "sequences": seqs, "owners": owners, "temperatures": seq_temps, "labels": labels,
                "draft": {k: v.detach().cpu() for k, v in own_state(draft).items()},
                "opt": kept[0] if kept else None, "step": step}, folder / STATE)
    report = _held_out(target, processor, draft, rows, held, states, seqs, owners, seq_temps, prefix,
                       max_new_tokens, samples_per_clip, label_batch, compile, seed) if held else None
    by_temp = {_tkey(t): sum(1 for x in seq_temps if x == t) for t in temps}
    decoding = " + ".join("greedy" if t == 0 else f"{samples_per_clip} samples at T={t:g}" for t in temps)
    info = {"data": data, "pseudo_labels": {"tokens": tokens, "max_new_tokens": max_new_tokens, "prefix": prefix,
                                            "seconds": round(data_s, 1), **labels, "sequences": by_temp,
                                            "decoding": f"target-only, per clip: {decoding}"},
            "steps": step, "batch": batch, "lr": lr, "train_seconds": round(train_s, 1),
            "loss_first_last": [round(losses[0], 4), round(sum(losses[-20:]) / len(losses[-20:]), 4)] if losses
            else None, "total_seconds": round(time.perf_counter() - t_start, 1),
            "held_out": report, "held_out_alpha": report["alpha_at"] if report else None,
            "held_out_clips": [ids[i] for i in held], "recipe": "distil-whisper KL, shared encoder"}
    save_distilled(draft, folder, target_id=target_identity(target, coarse=True), target_name=target_name, info=info)
    draft.eval()
    for p in trainable(draft):
        p.requires_grad_(False)
    log(f"distilled draft saved to {folder}: {step} steps, held-out α "
        f"{report['alpha_at'] if report else None}, tokens per step at T=0 "
        f"{report['tokens_per_step'] if report else None}")
    return draft, info


def _label(target, feats, prefix, max_new_tokens, temps, samples, batch, compile, seed, first: int) -> tuple:
    """Pseudo-labels of the clips ``first ..`` (features ``feats``) at every temperature: (sequences, clip index of
    each, temperature of each). Every sampled row has its own seed (``seed``, temperature and row)."""
    seqs, owners, seq_temps = [], [], []
    for t in temps:
        k = 1 if t == 0 else samples
        new = pseudo_labels(target, feats, prefix, max_new_tokens, batch_size=batch, compile=compile,
                            temperature=t, samples=k, seed=_seeds(seed, t, range(first, first + feats.shape[0]), k))
        seqs += new
        owners += [first + j // k for j in range(len(new))]
        seq_temps += [t] * len(new)
    return seqs, owners, seq_temps


def _held_out(target, processor, draft, rows, held, states, seqs, owners, seq_temps, prefix, max_new_tokens,
              samples, batch, compile, seed) -> dict:
    """The held-out report: the greedy agreement (``alpha``, ``alpha_per_step``, ``tokens_per_step``, suggested γ;
    as before sampled labels existed), ``alpha_at`` {T: α} and ``at_temperature`` {T: whisper_acceptance's report
    with its suggested γ} for T in 0, 1 and the training temperatures. Transcripts at a temperature training did not
    use are decoded here for the held-out clips."""
    from tilespec.engine.gamma import chain_gamma
    cost = len(draft.tilespec_distilled["layers"]) / draft.tilespec_distilled["total"]
    held_set = set(held)
    at = {}
    for t in sorted(set(EVAL_TEMPERATURES) | set(seq_temps)):
        picked = [j for j in range(len(seqs)) if owners[j] in held_set and seq_temps[j] == t]
        seq_t, own_t = [seqs[j] for j in picked], [owners[j] for j in picked]
        if not picked:
            feats = _features(processor, [rows[i]["audio"] for i in held], states.device)
            k = 1 if t == 0 else samples
            seq_t = pseudo_labels(target, feats, prefix, max_new_tokens, batch_size=batch, compile=compile,
                                  temperature=t, samples=k, seed=_seeds(seed, t, held, k))
            own_t = [held[j // k] for j in range(len(seq_t))]
        if t == 0:
            rep = agreement(target, draft, states[own_t], seq_t, prefix_len=len(prefix))
            rep["sequences"] = len(seq_t)
        else:
            rep = heldout_acceptance(target, draft, states, seq_t, owners=own_t, prefix_len=len(prefix),
                                     temperature=t)
        g, gain = chain_gamma([max(a, 1e-6) for a in rep["alpha_per_step"]], cost)
        rep.update(suggested_gamma=g, predicted_speedup=round(gain, 3), assumed_cost_ratio=round(cost, 3))
        at[_tkey(t)] = rep
    greedy = dict(at["0"])
    return {**greedy, "alpha_t0": at["0"]["alpha"], "alpha_t1": at["1"]["alpha"],
            "alpha_at": {k: v["alpha"] for k, v in at.items()}, "at_temperature": at}
