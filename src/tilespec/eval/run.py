"""``evaluate(cfg)``: load data and models, run the requested studies, return one JSON-able record.

Results files (``bench/results/eval-*.json``) hold ``{"kind": "eval", "runs": [record, ...]}``; writing a record
replaces the run with the same (task, dataset, target, draft, device) key and keeps the others, so several
invocations (summarization, then ASR) can share one file.
"""
from __future__ import annotations

import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Optional

import torch

from .data import load_dataset
from .harness import EvalConfig, clean, run_main
from .studies import acceptance_study, alphabeta_study, gamma_study
from .tasks import make_task


def environment(device: torch.device) -> dict:
    """Device name, library versions and the git commit of the checkout."""
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    env = dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
               platform=platform.platform(), commit=commit, date=time.strftime("%Y-%m-%d"))
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    else:
        env["device"] = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
        env["note"] = ("CPU run: tiled/fused/sigmoid are Triton kernels executed by Triton's interpreter "
                       "(TRITON_INTERPRET=1), so their times measure the interpreter, not the kernels")
    return env


def load_models(cfg: EvalConfig):
    """(target, draft, processor) from the model registry; the draft may be ``NAME:layers=N`` (shares weights)."""
    from tilespec.models import load

    target, proc = load(cfg.target, role="asr" if cfg.task == "asr" else "target", dtype=cfg.dtype,
                        device=cfg.device)
    draft = None
    if cfg.draft:
        spec = cfg.draft
        shares = spec.split(":", 1)[0] == cfg.target and ":layers=" in spec
        draft, _ = load(spec, role="draft", dtype=cfg.dtype, device=cfg.device, target=target if shares else None)
    return target, draft, proc


def evaluate(cfg: EvalConfig, models: Optional[tuple] = None, examples: Optional[list] = None,
             data_path: Optional[Path] = None, log=print) -> dict:
    """Run ``cfg.studies`` and return the record (see the module docstring for where it goes)."""
    from tilespec.verify.registry import get_method

    for method in cfg.methods:
        get_method(method)
    if any(m in ("tiled", "fused", "sigmoid") for m in cfg.methods):
        # import the kernels package before the models: without CUDA it selects Triton's interpreter, which must
        # happen before anything else imports triton (interpreted kernels fail otherwise)
        import tilespec.verify.kernels  # noqa: F401
    if examples is None:
        examples = load_dataset(cfg.task, cfg.dataset, cfg.limit, cfg.seed, data_path)
    elif cfg.limit is not None:
        examples = examples[:cfg.limit]
    if not examples:
        raise ValueError("no examples to evaluate")
    t0 = time.time()
    target, draft, proc = models if models is not None else load_models(cfg)
    task = make_task(cfg.task, proc, target, cfg.max_article_chars)
    device = next(target.parameters()).device
    record = dict(task=cfg.task, dataset=cfg.dataset, target=cfg.target, draft=cfg.draft,
                  metric=task.metric, n=len(examples), ids=[e["id"] for e in examples],
                  subsample=f"random.Random({cfg.seed}).sample of the dataset, limit={cfg.limit}",
                  synthetic=cfg.dataset == "synthetic", config=cfg.to_dict(), environment=environment(device),
                  references=[e["reference"] for e in examples])
    if cfg.dataset == "synthetic":
        record["note"] = "synthetic English speech from espeak-ng (XSum summaries); NOT LibriSpeech"
    log(f"{cfg.task}/{cfg.dataset}: {len(examples)} examples, target={cfg.target} draft={cfg.draft} "
        f"device={device}")
    if "main" in cfg.studies:
        record["methods"] = run_main(target, draft, task, examples, cfg, log)
    sub = examples[:cfg.sweep_limit]
    if "acceptance" in cfg.studies:
        record["acceptance"] = acceptance_study(target, draft, task, sub, cfg, log)
    if "gamma" in cfg.studies:
        record["gamma_sweep"] = gamma_study(target, draft, task, sub, cfg, log)
    if "alphabeta" in cfg.studies:
        record["alphabeta"] = alphabeta_study(target, draft, task, sub, cfg, log)
    record["sweep_n"] = len(sub)
    record["seconds"] = round(time.time() - t0, 1)
    return clean(record)


def run_key(rec: dict) -> tuple:
    env = rec.get("environment") or {}
    return (rec.get("task"), rec.get("dataset"), rec.get("target"), rec.get("draft"), env.get("device"))


def write_results(path: Path, record: dict) -> dict:
    """Add ``record`` to the results file at ``path`` (replacing a run with the same key); returns the file dict."""
    path = Path(path)
    doc = {"kind": "eval", "runs": []}
    if path.is_file():
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); refusing to overwrite it") from err
        if doc.get("kind") != "eval" or not isinstance(doc.get("runs"), list):
            raise ValueError(f"{path} is not an eval results file (expected kind 'eval' with 'runs')")
    doc["runs"] = [r for r in doc["runs"] if run_key(r) != run_key(record)] + [record]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc
