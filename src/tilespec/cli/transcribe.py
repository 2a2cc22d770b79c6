"""``tilespec transcribe``: Whisper transcription, target-only by default or speculative with a draft.

Defaults never lose to target-only decoding: no draft (no trained Whisper draft ships, and whisper-base's layer-skip
self-drafts accept almost nothing -- the 2-layer one's greedy tokens agree with the full decoder's at 0 % of positions,
in fp32 as in bf16), and with a ``--draft`` the ``optimal`` γ schedule, which stops drafting where the
measured acceptance and costs do not pay. The encoder runs once per batch; a layer-skip draft
(``whisper-base:layers=N``) and the distilled draft ``tilespec draft train --target whisper-base`` saves
(``--draft distilled`` or its folder) reuse the target's encoder output.
No logits processors are applied (HF ``generate`` suppresses some special tokens); the decoder prompt forces
<|startoftranscript|><|lang|><|transcribe|><|notimestamps|> (or <|startoftranscript|><|notimestamps|> for .en models).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tilespec.api import load_pair
from tilespec.env import pick_device, pick_dtype
from tilespec.models.whisper import decoder_prompt, features, load_audio

from .generate import add_decoding_arguments, check_decoding_args, positive_int, print_stats, sampling_from_args


def run(args) -> int:
    import torch
    from tilespec.engine import SpeculativeDecoder
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    check_decoding_args(args)
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
    p.add_argument("--draft", default=None, help="draft: distilled (the target's trained draft, `tilespec draft "
                                                 "train --target NAME`) or its folder, a model such as "
                                                 "whisper-base:layers=4, ngram, suffix or MODEL+ngram (default: none, "
                                                 "target-only decoding)")
    p.add_argument("--language", default="en")
    p.add_argument("--batch-size", type=positive_int, default=8)
    add_decoding_arguments(p)
    p.set_defaults(max_new_tokens=200, gamma_schedule="optimal", func=run)
