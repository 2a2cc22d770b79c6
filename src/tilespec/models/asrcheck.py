"""Transcription check of the Whisper models on the 8 transcribed LJSpeech clips (``python -m
tilespec.models.asrcheck --out models-wer-cpu.json``).

Audio: 22.05 kHz flac resampled to 16 kHz (polyphase, 320/441). Greedy decoding, English transcription.
Normaliser: lower case, punctuation removed except in-word apostrophes/hyphens-to-space, whitespace collapsed.
WER = total word errors / total reference words over the clips (jiwer), against both transcript columns
(``text`` has digits like "1455", ``normalized`` spells them out).
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import time
from pathlib import Path

import numpy as np
import torch

DATA = Path(__file__).resolve().parents[4] / "shared" / "data" / "ljspeech"


def normalise(text: str) -> str:
    text = text.lower().replace("-", " ")
    text = re.sub(r"[^a-z0-9' ]+", " ", text)
    return re.sub(r"\s+", " ", text).strip()


def read_clips(data: Path) -> list[dict]:
    """The transcribed clips: [{id, text, normalized, audio (float32 [n] at 16 kHz)}]."""
    import soundfile as sf
    from scipy.signal import resample_poly

    rows = []
    for line in (data / "metadata.csv").read_text().splitlines():
        if not line.strip():
            continue
        cid, text, norm = line.split("|")[:3]
        audio, sr = sf.read(data / "wavs" / f"{cid}.flac", dtype="float32")
        if audio.ndim > 1:
            audio = audio.mean(axis=1)
        if sr != 16000:
            g = np.gcd(sr, 16000)
            audio = resample_poly(audio, 16000 // g, sr // g).astype(np.float32)
        rows.append(dict(id=cid, text=text, normalized=norm, audio=audio))
    return rows


def transcribe(name: str, clips: list[dict]) -> list[str]:
    from .loading import load

    model, proc = load(name, role="asr", dtype=torch.float32)
    kw = {} if name.endswith(".en") else dict(language="en", task="transcribe")
    out = []
    with torch.inference_mode():
        for c in clips:
            feats = proc(c["audio"], sampling_rate=16000, return_tensors="pt").input_features
            ids = model.generate(feats, do_sample=False, num_beams=1, max_new_tokens=200, **kw)
            out.append(proc.batch_decode(ids, skip_special_tokens=True)[0].strip())
    del model
    return out


def main(argv=None) -> int:
    import jiwer
    import transformers

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["whisper-tiny.en", "whisper-base"])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    clips = read_clips(args.data)
    result = dict(date=time.strftime("%Y-%m-%d"), clips=[c["id"] for c in clips], device="cpu",
                  versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                                jiwer=getattr(jiwer, "__version__", "?"), python=platform.python_version()),
                  decoding="greedy, fp32, max_new_tokens=200; base: language=en task=transcribe",
                  normaliser=normalise.__doc__ or "lower-case, strip punctuation", models={})
    for name in args.models:
        t0 = time.time()
        hyps = transcribe(name, clips)
        per = {}
        for col in ("text", "normalized"):
            refs = [normalise(c[col]) for c in clips]
            per[col] = round(float(jiwer.wer(refs, [normalise(h) for h in hyps])), 4)
        result["models"][name] = dict(wer_vs_text=per["text"], wer_vs_normalized=per["normalized"],
                                      seconds=round(time.time() - t0, 1),
                                      hypotheses={c["id"]: h for c, h in zip(clips, hyps)})
        print(name, per, f"{time.time() - t0:.1f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
