"""CPU proof of concept: a Distil-Whisper-style 2-layer draft for whisper-base trained by the library
(tilespec.training.whisper_draft) on the target's own transcripts of LJSpeech clips, against the layer-skip self-draft.

Usage: python3 bench/scripts/whisper_distill_cpu.py --json OUT.json [--steps 200] [--train 9-32] [--heldout 1-8]
Clips are LJ001-00NN from /work/shared/data/ljspeech/wavs; training uses --train, α is measured on the held-out
clips and the first --alpha-train-clips training clips (engine, greedy, constant γ = 3, accepted / tested
positions) for: whisper-base:layers=2 (layer skip), the student
before training (copies of decoder layers 0 and 5 + final norm), and after.
"""
from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

from tilespec.api import load_pair
from tilespec.training.whisper_draft import distill, encoder_states, pseudo_labels, student
from tilespec.engine import SpeculativeDecoder
from tilespec.env import git_commit, versions
from tilespec.models.layerskip import layer_skip_draft
from tilespec.models.whisper import decoder_prompt, features, load_audio
from tilespec.verify import SamplingParams


def clips(spec: str) -> list:
    lo, hi = (int(x) for x in spec.split("-"))
    return [Path(f"/work/shared/data/ljspeech/wavs/LJ001-{i:04d}.flac") for i in range(lo, hi + 1)]


def alpha(target, draft, feats, prefix, n: int) -> dict:
    dec = SpeculativeDecoder(target, draft, gamma=3, sampling=SamplingParams.greedy())
    accepted = tested = 0
    for i in range(0, feats.shape[0], 8):
        chunk = feats[i:i + 8]
        s = dec.generate([list(prefix)] * chunk.shape[0], max_new_tokens=n, input_features=chunk).stats
        accepted, tested = accepted + s.accepted, tested + s.tested
    return {"alpha_tested": accepted / tested if tested else None, "accepted": accepted, "tested": tested}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--train", default="9-32")
    p.add_argument("--heldout", default="1-8")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--alpha-train-clips", type=int, default=8, help="training clips α is also measured on")
    args = p.parse_args()
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    target, _, tok = load_pair("whisper-base", None, cpu, torch.float32)
    prefix = decoder_prompt(target, tok, "en")
    sets = {name: features(tok, [load_audio(c) for c in clips(spec)], cpu, torch.float32)
            for name, spec in (("train", args.train), ("heldout", args.heldout))}
    t0 = time.time()
    seqs = pseudo_labels(target, sets["train"], prefix, args.max_new_tokens)
    states = encoder_states(target, sets["train"])
    label_s = time.time() - t0
    drafts = {"layerskip-2": layer_skip_draft(target, 2), "student-untrained": student(target)}
    result = {"what": "Distil-Whisper-style 2-layer draft (decoder layers 0 and 5 copied, trained on the target's own "
                      "transcripts with KL) vs the layer-skip self-draft, whisper-base fp32, CPU, engine α at γ = 3",
              "device": "cpu", "versions": versions(), "commit": git_commit(),
              "date": datetime.date.today().isoformat(), "settings": vars(args) | {"json": str(args.json)},
              "train_clips": [c.name for c in clips(args.train)],
              "heldout_clips": [c.name for c in clips(args.heldout)],
              "pseudo_label_tokens": sum(len(s) - len(prefix) for s in seqs), "pseudo_label_seconds": round(label_s, 1),
              "alpha": {}}
    measured = {"train": sets["train"][:args.alpha_train_clips], "heldout": sets["heldout"]}
    for name, d in drafts.items():
        result["alpha"][name] = {k: alpha(target, d, f, prefix, args.max_new_tokens) for k, f in measured.items()}
        print(name, result["alpha"][name], flush=True)
    t0 = time.time()
    losses = distill(target, drafts["student-untrained"], states, seqs, prefix_len=len(prefix), steps=args.steps,
                     lr=args.lr, batch_size=args.batch_size,
                     log=lambda s, l: print(f"step {s} loss {l:.3f}", flush=True) if s % 20 == 0 else None)
    result["train_seconds"] = round(time.time() - t0, 1)
    result["loss_first_last"] = [losses[0], sum(losses[-10:]) / 10]
    result["alpha"]["student-trained"] = {k: alpha(target, drafts["student-untrained"], f, prefix,
                                                   args.max_new_tokens) for k, f in measured.items()}
    print("student-trained", result["alpha"]["student-trained"], flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
