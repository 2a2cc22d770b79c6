"""``tilespec draft train --target <a Whisper model>``: :func:`train_whisper_draft` trains and saves a distilled draft.

Recipe (Distil-Whisper's, at the scale of minutes): the target's encoder kept and shared, a decoder of copies of the
target's decoder layers (default: the first and the last), pseudo-labels = the target's own greedy transcripts of
the training speech, loss KL(p_target || p_draft) per transcript position (whisper_draft.py).

Training speech (:func:`training_speech`), never the evaluation clips:
  * LJSpeech clips LJ001-0017 .. LJ001-0032 (``tilespec.datasets.ljspeech_split``; LJ001-0001 .. 0016 are the
    evaluation clips and are dropped from any folder given);
  * synthetic speech: set folders written by ``python -m bench.synth --text documents`` (sentences of XSum
    *articles* spoken by espeak-ng; the synthetic evaluation set speaks XSum *summaries*), by default
    ``$TILESPEC_HOME/data/synth-train``; clips whose transcript is also in the synthetic evaluation set
    (``$TILESPEC_SYNTH_DIR``) are dropped.
A share of the training clips (``heldout``, chosen with ``seed``) is held out for the acceptance estimate.

Budget (``minutes``): speech loading, features, pseudo-labels and encoder states first, then training until the
budget less a reserve for the held-out estimate and saving. Resumable: ``out/train-state.pt`` holds the clip ids, the
pseudo-labels, the draft's weights, the optimiser and the step; a rerun with the same folder and speech continues.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from tilespec.heads.distilled import draft_dir, save_distilled
from tilespec.heads.store import target_identity
from tilespec.models.distilled import load_own_state, own_state, student, trainable

from .whisper_draft import agreement, distill, encoder_states, pseudo_labels

STATE = "train-state.pt"
DEFAULT_SYNTH = "synth-train"


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
                        log=print, prefix: Optional[list] = None, data_share: float = 0.4) -> tuple:
    """Train a distilled draft for the float32 Whisper ``target`` and save it (``out``, default
    ``$TILESPEC_HOME/drafts/<target_name>/``). ``speech``: sources for :func:`training_speech` (or a ready list of
    ``{id, audio}``); ``prefix``: the decoder prompt (default: transcription in ``language``, no timestamps);
    ``data_share``: pseudo-labelling stops after that share of the budget (the clips left are not used).
    Returns (draft, report); the report is also the manifest's body."""
    from tilespec.models.whisper import decoder_prompt
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
    elif saved is not None:          # the clips the saved pseudo-labels cover
        rows, ids = rows[:len(saved["ids"])], saved["ids"]
    prefix = list(prefix) if prefix is not None else decoder_prompt(target, processor, language)
    t_data = time.perf_counter()
    seqs, states = [], []
    for i in range(0, len(rows), label_batch):
        if saved is None and i and time.perf_counter() - t_start > data_share * budget:
            log(f"pseudo-labels: {data_share:.0%} of the budget spent, training on {i} of {len(rows)} clips")
            rows, ids = rows[:i], ids[:i]
            data["clips_used"] = i
            break
        feats = _features(processor, [r["audio"] for r in rows[i:i + label_batch]], dev)
        if saved is None:
            seqs += pseudo_labels(target, feats, prefix, max_new_tokens, batch_size=label_batch, compile=compile)
        states.append(encoder_states(target, feats, batch_size=label_batch))
    states = torch.cat(states)
    if saved is not None:
        seqs = saved["sequences"]
        log(f"resuming from {folder / STATE}: step {saved['step']}")
    data_s = time.perf_counter() - t_data
    n = len(rows)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_held = max(1, int(round(heldout * n))) if n > 1 else 0
    held, train = sorted(perm[:n_held]), sorted(perm[n_held:]) or sorted(perm)
    tokens = sum(len(s) - len(prefix) for s in seqs)
    log(f"pseudo-labels: {tokens} tokens from {n} clips in {data_s:.1f} s; {len(train)} train / {n_held} held out")
    draft = student(target, layers)
    if saved is not None:
        load_own_state(draft, saved["draft"])
    start = saved["step"] if saved is not None else 0
    steps = max_steps if max_steps is not None else 10 ** 9
    reserve = min(30.0, 0.1 * budget)
    seconds = max(0.0, budget - reserve - (time.perf_counter() - t_start))
    log(f"training {'until step ' + str(steps) if max_steps else f'for {seconds:.0f} s'} (batch {batch}, lr {lr})")
    t_train, kept = time.perf_counter(), []
    losses = distill(target, draft, states[train], [seqs[i] for i in train], prefix_len=len(prefix), steps=steps,
                     lr=lr, batch_size=batch, warmup=warmup, seed=seed, seconds=seconds if max_steps is None else None,
                     start_step=start, optimizer_state=saved["opt"] if saved is not None else None,
                     keep_optimizer=kept,
                     log=lambda s, v: log(f"step {s} KL {v:.4f}") if s % 200 == 0 else None)
    train_s = time.perf_counter() - t_train
    step = start + len(losses)
    torch.save({"ids": ids, "sequences": seqs, "draft": {k: v.detach().cpu() for k, v in own_state(draft).items()},
                "opt": kept[0] if kept else None, "step": step}, folder / STATE)
    report = agreement(target, draft, states[held], [seqs[i] for i in held], prefix_len=len(prefix)) \
        if held else None
    from tilespec.engine.gamma import chain_gamma
    cost = len(draft.tilespec_distilled["layers"]) / draft.tilespec_distilled["total"]
    if report is not None:
        g, gain = chain_gamma([max(a, 1e-6) for a in report["alpha_per_step"]], cost)
        report.update(suggested_gamma=g, predicted_speedup=round(gain, 3), assumed_cost_ratio=round(cost, 3))
    info = {"data": data, "pseudo_labels": {"tokens": tokens, "max_new_tokens": max_new_tokens, "prefix": prefix,
                                            "seconds": round(data_s, 1), "decoding": "target greedy, target-only"},
            "steps": step, "batch": batch, "lr": lr, "train_seconds": round(train_s, 1),
            "loss_first_last": [round(losses[0], 4), round(sum(losses[-20:]) / len(losses[-20:]), 4)] if losses
            else None, "total_seconds": round(time.perf_counter() - t_start, 1),
            "held_out": report, "held_out_clips": [ids[i] for i in held], "recipe": "distil-whisper KL, shared encoder"}
    save_distilled(draft, folder, target_id=target_identity(target, coarse=True), target_name=target_name, info=info)
    draft.eval()
    for p in trainable(draft):
        p.requires_grad_(False)
    log(f"distilled draft saved to {folder}: {step} steps, held-out α "
        f"{report['alpha'] if report else None}, tokens per step {report['tokens_per_step'] if report else None}")
    return draft, info
