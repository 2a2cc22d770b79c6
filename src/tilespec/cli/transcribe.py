"""``tilespec transcribe``: speculative Whisper transcription (target + layer-skip or smaller Whisper draft).

The encoder runs once per batch; a layer-skip draft (``whisper-base:layers=2``) reuses the target's encoder output.
No logits processors are applied (HF ``generate`` suppresses some special tokens); the decoder prompt forces
<|startoftranscript|><|lang|><|transcribe|><|notimestamps|> (or <|startoftranscript|><|notimestamps|> for .en models).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .generate import add_decoding_arguments, load_pair, pick_device, pick_dtype, print_stats, sampling_from_args

SAMPLE_RATE = 16000


def load_audio(path: Path):
    """Mono float32 samples at 16 kHz (any rate soundfile reads is resampled with a polyphase filter)."""
    import numpy as np
    import soundfile as sf
    from math import gcd
    from scipy.signal import resample_poly
    if not Path(path).is_file():
        raise FileNotFoundError(f"audio file not found: {path}")
    data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    mono = data.mean(axis=1)
    if rate != SAMPLE_RATE:
        g = gcd(int(rate), SAMPLE_RATE)
        mono = resample_poly(mono, SAMPLE_RATE // g, int(rate) // g).astype(np.float32)
    return mono


def decoder_prompt(model, tok, language: str = "en") -> list:
    """The forced decoder prefix token ids for plain transcription without timestamps."""
    gc = model.generation_config
    sot = gc.decoder_start_token_id
    no_ts = getattr(gc, "no_timestamps_token_id", None)
    tokenizer = getattr(tok, "tokenizer", tok)
    if no_ts is None:
        no_ts = tokenizer.convert_tokens_to_ids("<|notimestamps|>")
    if getattr(gc, "is_multilingual", False):
        lang_ids = getattr(gc, "lang_to_id", {}) or {}
        key = f"<|{language}|>"
        if key not in lang_ids:
            raise ValueError(f"unknown language {language!r} for this Whisper model")
        task = (getattr(gc, "task_to_id", {}) or {}).get("transcribe")
        return [sot, lang_ids[key], task, no_ts]
    return [sot, no_ts]


def features(tok, audios, device, dtype):
    extractor = getattr(tok, "feature_extractor", tok)
    feats = extractor(audios, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
    return feats.to(device=device, dtype=dtype)


def run(args) -> int:
    import torch
    from tilespec.engine import SpeculativeDecoder
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    audios = [load_audio(Path(a)) for a in args.audio]
    target, draft, tok = load_pair(args.target, args.draft, device, dtype,
                                   log=lambda m: print(m, file=sys.stderr))
    tokenizer = getattr(tok, "tokenizer", tok)
    dec = SpeculativeDecoder(target, draft, gamma=args.gamma, gamma_schedule=args.gamma_schedule,
                             method=args.method, sampling=sampling_from_args(args), tokenizer=tokenizer,
                             compile=args.compile)
    prefix = decoder_prompt(target, tok, args.language)
    results = []
    for start in range(0, len(audios), args.batch_size):
        chunk = audios[start:start + args.batch_size]
        with torch.inference_mode():
            out = dec.generate([prefix] * len(chunk), max_new_tokens=args.max_new_tokens, seed=args.seed,
                               input_features=features(tok, chunk, device, dtype))
        for i, text in enumerate(out.texts):
            path = args.audio[start + i]
            print(f"{path}\t{text.strip()}")
            results.append({"audio": str(path), "text": text.strip(), "tokens": out.sequences[i]})
        print_stats(dec.last_stats, title=f"{args.target} + {args.draft or 'no draft'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"target": args.target, "draft": args.draft, "results": results,
                                         "stats": dec.last_stats.to_dict()}, indent=2))
    return 0


def register(sub) -> None:
    p = sub.add_parser("transcribe", help="speculative Whisper transcription of audio files")
    p.add_argument("audio", nargs="+", help="audio files (wav, flac, ...)")
    p.add_argument("--target", default="whisper-base", help="Whisper target (default whisper-base)")
    p.add_argument("--draft", default="whisper-base:layers=2", help="draft (default whisper-base:layers=2)")
    p.add_argument("--language", default="en")
    p.add_argument("--batch-size", type=int, default=8)
    add_decoding_arguments(p)
    p.set_defaults(max_new_tokens=200, func=run)
