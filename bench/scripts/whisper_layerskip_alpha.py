"""Is whisper-base's layer-skip self-draft's α = 0 a precision defect or the draft's quality? (CPU, real weights.)

Usage: python3 bench/scripts/whisper_layerskip_alpha.py --json OUT.json [--clips 4] [--layers 1,2,3,4,5]
Two measurements on LJSpeech clips (``$TILESPEC_DATA``/ljspeech or /work/shared/data/ljspeech):
  * teacher-forced greedy agreement of the early exit (first N decoder layers + the final norm + the LM head, i.e.
    ``layer_skip_draft``) with the full decoder, through transformers only (no tilespec engine), per N and dtype
    (fp32, bf16; fp16 on CPU where its kernels exist), over the target's own greedy transcript;
  * the engine's α (accepted / tested draft positions) decoding with ``whisper-base:layers=2``, γ = 3, per dtype.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import glob
import json
import time
from pathlib import Path

import torch

from tilespec.api import load_pair
from tilespec.engine import SpeculativeDecoder
from tilespec.env import git_commit, versions
from tilespec.models.layerskip import layer_skip_draft
from tilespec.models.whisper import decoder_prompt, features, load_audio
from tilespec.verify import SamplingParams

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def agreement(target, tok, audios, layers: list, dtype, new_tokens: int) -> dict:
    prefix = decoder_prompt(target, tok, "en")
    out = {}
    with torch.no_grad():
        enc = target.model.encoder(features(tok, audios, torch.device("cpu"), dtype)).last_hidden_state
        ids = torch.tensor([prefix] * len(audios))
        for _ in range(new_tokens):
            step = target(encoder_outputs=(enc,), decoder_input_ids=ids).logits[:, -1]
            ids = torch.cat([ids, step.argmax(-1, keepdim=True)], 1)
        full = target(encoder_outputs=(enc,), decoder_input_ids=ids).logits.argmax(-1)[:, len(prefix) - 1:]
        eos = target.generation_config.eos_token_id
        # positions up to and including the target's first EOS (after it both just repeat end-of-text)
        ended = (full == eos).long().cumsum(1)
        scored = (ended == 0) | ((ended == 1) & (full == eos))
        decode = getattr(tok, "tokenizer", tok).decode
        for n in layers:
            pred = layer_skip_draft(target, n)(encoder_outputs=(enc,), decoder_input_ids=ids).logits.argmax(-1)
            pred = pred[:, len(prefix) - 1:][scored]
            common = collections.Counter(pred.tolist()).most_common(3)
            out[str(n)] = {"agreement": round((pred == full[scored]).float().mean().item(), 4),
                           "positions": int(scored.sum()),
                           "most_common_draft_tokens": [[decode([t]), c] for t, c in common]}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--clips", type=int, default=4)
    p.add_argument("--layers", default="1,2,3,4,5")
    p.add_argument("--dtypes", default="fp32,bf16,fp16")
    p.add_argument("--new-tokens", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(1)
    paths = sorted(glob.glob("/work/shared/data/ljspeech/wavs/*.flac"))[:args.clips]
    audios = [load_audio(Path(c)) for c in paths]
    layers = [int(x) for x in args.layers.split(",")]
    result = {"what": "whisper-base layer-skip self-draft: teacher-forced greedy agreement and engine α, CPU",
              "device": "cpu", "versions": versions(), "commit": git_commit(),
              "date": datetime.date.today().isoformat(), "clips": [Path(c).name for c in paths], "runs": {}}
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        target, draft, tok = load_pair("whisper-base", "whisper-base:layers=2", torch.device("cpu"), dtype)
        run = {"teacher_forced": agreement(target, tok, audios, layers, dtype, args.new_tokens)}
        dec = SpeculativeDecoder(target, draft, gamma=3, sampling=SamplingParams.greedy(),
                                 tokenizer=getattr(tok, "tokenizer", tok))
        t0 = time.time()
        out = dec.generate([decoder_prompt(target, tok, "en")] * len(audios), max_new_tokens=args.new_tokens,
                           input_features=features(tok, audios, torch.device("cpu"), dtype))
        s = out.stats
        run["engine_layers2"] = {"accepted": s.accepted, "tested": s.tested, "drafted": s.drafted,
                                 "alpha_tested": s.accepted / s.tested if s.tested else None,
                                 "seconds": round(time.time() - t0, 1), "first_text": out.texts[0].strip()}
        result["runs"][name] = run
        print(name, json.dumps(run)[:400], flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
