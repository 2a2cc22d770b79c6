"""``evaluate(cfg)`` (``tilespec eval``): load data and models, decode the same examples with every method, and
return one JSON-able record of measured quality (ROUGE / WER) beside speed (time inside ``verify()``, wall clock,
acceptance, peak memory) per method.

Side studies (γ sweeps, acceptance vs initial γ, sigmoid scales) are not part of the library: a caller passes them
as ``studies`` (the repository's ``bench.studies`` does), and ``evaluate`` runs them after the main comparison
under the same time budget, resume and record rules.

Results files (``bench/results/eval-*.json``) hold ``{"kind": "eval", "runs": [record, ...]}``; writing a record
replaces the run with the same (task, dataset, target, draft, device) key and keeps the others, so several
invocations (summarization, then ASR) can share one file.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import torch

from tilespec.env import run_record

from tilespec.datasets import load_dataset
from .aggregate import clean
from .config import EvalConfig
from .harness import run_main
from .tasks import make_task


def environment(device: torch.device) -> dict:
    """The run record (``tilespec.env.run_record``: device, versions, commit, date), plus a note on CPU runs."""
    env = run_record(device, short_commit=True)
    if device.type != "cuda":
        env["note"] = ("CPU run: tiled/fused/sigmoid are Triton kernels executed by Triton's interpreter "
                       "(TRITON_INTERPRET=1), so their times measure the interpreter, not the kernels")
    return env


def load_models(cfg: EvalConfig):
    """(target, draft, processor) from the model registry; the draft may be ``NAME:layers=N`` (shares weights),
    "distilled" or a distilled draft's folder (the target's trained Whisper draft), "ngram" / "suffix" or MODEL+ngram
    (then ``draft`` is the engine's ``draft=`` argument)."""
    from tilespec.engine.drafters import draft_spec, split_draft_name
    from tilespec.models import load

    target, proc = load(cfg.target, role="asr" if cfg.task == "asr" else "target", dtype=cfg.dtype,
                        device=cfg.device)
    draft = None
    spec, context = split_draft_name(cfg.draft)
    from tilespec.heads.distilled import find_folder, is_distilled_name, load_distilled
    if spec and is_distilled_name(spec):       # the target's trained draft (tilespec draft train)
        draft = load_distilled(find_folder(spec, str(cfg.target)), target, target_name=str(cfg.target))
    elif spec:
        shares = spec.split(":", 1)[0] == cfg.target and ":layers=" in spec
        draft, _ = load(spec, role="draft", dtype=cfg.dtype, device=cfg.device, target=target if shares else None)
    return target, draft_spec(draft, context), proc


RESUME_FREE = ("time_budget", "main_share", "studies", "sweep_limit", "sweep_gammas", "accept_gammas", "scales",
               "sweep_max_new_tokens", "sweep_schedule", "summary_every_s", "warmup")   # settings that do not change the main comparison's outputs


def resumable(previous: Optional[dict], cfg: EvalConfig, ids: list) -> Optional[str]:
    """None when ``previous`` (a record of the same run key) can be resumed by ``cfg`` on the examples ``ids``,
    else why not: the main comparison must have the same settings (all but :data:`RESUME_FREE`) and examples."""
    if not previous:
        return "no earlier record"
    old = previous.get("config") or {}
    new = cfg.to_dict()
    diff = [k for k in new if k not in RESUME_FREE and old.get(k, None if k != "batch_size" else 1) != new[k]]
    if diff:
        return f"settings differ ({', '.join(diff)})"
    if (previous.get("ids_requested") or previous.get("ids")) != ids:
        return "the examples differ"
    return None


def evaluate(cfg: EvalConfig, models: Optional[tuple] = None, examples: Optional[list] = None,
             data_path: Optional[Path] = None, log=print, on_update=None, previous: Optional[dict] = None,
             studies: Optional[dict] = None) -> dict:
    """Run ``cfg.studies`` and return the record (see the module docstring for where it goes).

    ``studies``: {study name: (record key, fn(target, draft, task, examples, cfg, log, deadline=...) -> JSON)} of the
    side studies ``cfg.studies`` may name besides ``main``; a name without an entry raises ValueError before any
    model is loaded.

    ``on_update(record)`` is called with the (JSON-safe) record after each chunk of the main comparison and after
    each study, so a run that is killed later still leaves what it finished on disk (at most one chunk is lost).
    ``previous``: the record of an earlier invocation of the same run (same key in the results file); when
    :func:`resumable`, its raw chunks and finished side studies are kept and only what is missing is decoded.
    With ``cfg.time_budget`` (seconds from the call, model loading included) the main comparison may use
    ``cfg.main_share`` of what is left after loading and each side study an equal share of the rest; a study past
    its deadline starts nothing new (see run_main / studies)."""
    t0 = time.time()
    studies = _known_studies(cfg, studies)
    examples = _examples(cfg, examples, data_path)
    ids = [e["id"] for e in examples]
    why = resumable(previous, cfg, ids)
    if previous and why:
        log(f"  not resuming the earlier record: {why}; starting afresh")
    previous = previous if why is None else None
    target, draft, proc = models if models is not None else load_models(cfg)
    t_loaded = time.time()
    task = make_task(cfg.task, proc, target, cfg.max_article_chars)
    device = next(target.parameters()).device
    run = _Run(cfg, examples, t0, on_update, _new_record(cfg, examples, task, device, round(t_loaded - t0, 1)))
    _carry_over(run.record, previous, studies)
    if cfg.dataset == "synthetic":
        _describe_synthetic(run.record, examples, data_path)
    log(f"[{time.strftime('%H:%M:%S')}] {cfg.task}/{cfg.dataset}: {len(examples)} examples, target={cfg.target} "
        f"draft={cfg.draft} device={device} T={cfg.temperature} batch={cfg.batch_size} "
        f"(models loaded in {t_loaded - t0:.1f} s{', resuming' if previous else ''})")
    deadline_total = t0 + cfg.time_budget if cfg.time_budget else None
    side_todo = [s for s in cfg.studies if s != "main" and studies[s][0] not in run.record]
    if "main" in cfg.studies:
        deadline = None
        if deadline_total is not None:
            share = cfg.main_share if side_todo else 1.0
            deadline = t_loaded + share * (deadline_total - t_loaded)
        examples = _main_comparison(run, target, draft, task, previous, deadline, log)
    sub = examples[:cfg.sweep_limit]
    if any(s != "main" for s in cfg.studies):
        run.record["sweep_n"] = len(sub)
    _side_studies(run, [(name, *studies[name]) for name in side_todo], target, draft, task, sub, deadline_total, log)
    run.record["seconds"] = round(time.time() - t0, 1)
    return clean(run.record)


def _known_studies(cfg: EvalConfig, studies: Optional[dict]) -> dict:
    """``studies`` as a dict, once every side study ``cfg.studies`` names has an entry (ValueError otherwise); the
    kernels package imported first when a method needs Triton (without CUDA it selects Triton's interpreter, which
    must happen before anything else imports triton)."""
    from tilespec.verify.registry import get_method

    studies = dict(studies or {})
    unknown = [s for s in cfg.studies if s != "main" and s not in studies]
    if unknown:
        raise ValueError(f"unknown stud{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}: the library runs "
                         "the main comparison; side studies come from the caller (python -m bench.studies)")
    if any(get_method(m).needs_triton for m in cfg.methods):
        import tilespec.verify.kernels  # noqa: F401
    return studies


def _examples(cfg: EvalConfig, examples: Optional[list], data_path: Optional[Path]) -> list:
    """The given examples (at most ``cfg.limit``), else the dataset's sample; ValueError when there are none."""
    if examples is None:
        examples = load_dataset(cfg.task, cfg.dataset, cfg.limit, cfg.seed, data_path)
    elif cfg.limit is not None:
        examples = examples[:cfg.limit]
    if not examples:
        raise ValueError("no examples to evaluate")
    return examples


def _references(examples: list) -> list:
    return [e.get("references") or e["reference"] for e in examples]


def _new_record(cfg: EvalConfig, examples: list, task, device: torch.device, load_seconds: float) -> dict:
    """The run's record before anything is decoded: what is evaluated, on what, with which settings."""
    ids = [e["id"] for e in examples]
    record = dict(task=cfg.task, dataset=cfg.dataset, target=cfg.target, draft=cfg.draft,
                  metric=task.metric, n=len(examples), ids=ids, ids_requested=ids,
                  subsample=f"random.Random({cfg.seed}).sample of the dataset, limit={cfg.limit}",
                  synthetic=cfg.dataset == "synthetic", config=cfg.to_dict(), environment=environment(device),
                  references=_references(examples), n_requested=len(examples),
                  batch_size=cfg.batch_size, load_seconds=load_seconds)
    if cfg.batch_size > 1:
        record["protocol_note"] = (f"batched main comparison ({cfg.batch_size} examples per generation, seeds "
                                   "seed + i per example): timings are per batched step, not the paper's batch-1 "
                                   "protocol; Δ% compares methods at the same batch size")
    return record


def _carry_over(record: dict, previous: Optional[dict], studies: dict) -> None:
    """Keep a resumable earlier record's finished side studies and stages (the main comparison's raw chunks are
    taken by :func:`_main_comparison`)."""
    if not previous:
        return
    record["resumed"] = previous.get("resumed", 0) + 1
    for key in [k for k, _ in studies.values()] + ["sweep_n"]:
        if key in previous:
            record[key] = previous[key]
    record["stages_done"] = [s for s in previous.get("stages_done", []) if s != "main"]


def _describe_synthetic(record: dict, examples: list, data_path: Optional[Path]) -> None:
    """The synthetic set's caveat, its meta.json (when the set folder has one) and its voices."""
    from tilespec.datasets import SYNTHETIC_CAVEAT, synthetic_dir

    record["note"] = f"{SYNTHETIC_CAVEAT} (XSum summaries spoken by espeak-ng; exact transcripts)"
    folder = synthetic_dir(data_path)
    meta = folder / "meta.json" if folder is not None else None
    if meta is not None and meta.is_file():
        record["synthetic_set"] = json.loads(meta.read_text())
    record["voices"] = sorted({e.get("voice") for e in examples if e.get("voice")})


class _Run:
    """One evaluation's record with the examples it was sampled from: saving it and setting the main comparison's
    rows over the examples every method finished."""

    def __init__(self, cfg: EvalConfig, examples: list, t0: float, on_update, record: dict):
        self.cfg, self.examples, self.t0, self.on_update, self.record = cfg, examples, t0, on_update, record

    def save(self, stage: Optional[str]) -> None:
        """Stamp the seconds so far, add ``stage`` to the stages done, and hand a JSON-safe copy to ``on_update``."""
        record = self.record
        record["seconds"] = round(time.time() - self.t0, 1)
        if stage is not None and stage not in record.get("stages_done", []):
            record["stages_done"] = record.get("stages_done", []) + [stage]
        if self.on_update is not None:
            self.on_update(clean(record))

    def set_main(self, rows: Optional[dict]) -> None:
        """The per-method ``rows`` (None: keep the last ones) over the examples every method has finished."""
        from .chunks import common_examples

        record, examples = self.record, self.examples
        common = common_examples(record["raw"], self.cfg.methods)
        if rows is not None:
            record["methods"] = rows
        record.update(n=len(common), ids=[record["ids_requested"][i] for i in common],
                      references=_references(examples[i] for i in common), examples_idx=common)
        if len(common) < len(examples):
            record["budget_note"] = (f"main comparison on {len(common)} of {record['n_requested']} sampled examples "
                                     "so far (run the same command again to resume)")
        else:
            record.pop("budget_note", None)


def _main_comparison(run: _Run, target, draft, task, previous: Optional[dict], deadline: Optional[float],
                     log) -> list:
    """Decode every example with every method (resuming ``previous``'s raw chunks) until ``deadline``; the quality
    rows are refreshed at most every ``summary_every_s`` seconds while chunks arrive. -> the examples finished."""
    cfg, record = run.cfg, run.record
    record["raw"] = (previous or {}).get("raw") or {}
    last = [0.0]

    def on_chunk(raw, rows_fn) -> None:
        record["raw"] = raw
        fresh = time.time() - last[0] > cfg.summary_every_s   # ROUGE / WER of every text: not every chunk
        run.set_main(rows_fn() if fresh else None)
        if fresh:
            last[0] = time.time()
            record["methods_n"] = record["n"]              # the examples the "methods" rows cover
        run.save(None)

    run.set_main(run_main(target, draft, task, run.examples, cfg, log, deadline=deadline, raw=record["raw"],
                          on_chunk=on_chunk))
    record["methods_n"] = done = record["n"]
    complete = done == record["n_requested"]
    if complete:
        record["stages_done"] = [s for s in record.get("stages_done", []) if s != "main-partial"]
    run.save("main" if complete else "main-partial")
    return run.examples if complete else [run.examples[i] for i in record["examples_idx"]]


def _side_studies(run: _Run, todo: list, target, draft, task, sub: list, deadline_total: Optional[float],
                  log) -> None:
    """Run each (name, record key, fn) of ``todo`` on ``sub``, each with an equal share of the time left; a study
    reached after the total deadline is listed under "skipped"."""
    for i, (name, key, fn) in enumerate(todo):
        deadline = None
        if deadline_total is not None:
            deadline = time.time() + (deadline_total - time.time()) / (len(todo) - i)
            if time.time() >= deadline_total:
                log(f"  time budget spent: {name} study skipped")
                run.record.setdefault("skipped", []).append(name)
                continue
        log(f"[{time.strftime('%H:%M:%S')}] {name} study on {len(sub)} example(s)")
        run.record[key] = fn(target, draft, task, sub, run.cfg, log, deadline=deadline)
        run.save(name)


def find_run(path: Path, cfg: EvalConfig) -> Optional[dict]:
    """The record in the results file ``path`` with the run key ``cfg`` will produce (None if none)."""
    from tilespec.env import device_name

    device = device_name(torch.device(cfg.device))
    path = Path(path)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    probe = dict(task=cfg.task, dataset=cfg.dataset, target=cfg.target, draft=cfg.draft,
                 environment=dict(device=device), config=cfg.to_dict())
    return next((r for r in doc.get("runs", []) if run_key(r) == run_key(probe)), None)


def run_key(rec: dict) -> tuple:
    """Runs with the same key replace each other in a results file: (task, dataset, target, draft, device,
    temperature, studies)."""
    env = rec.get("environment") or {}
    cfg = rec.get("config") or {}
    return (rec.get("task"), rec.get("dataset"), rec.get("target"), rec.get("draft"), env.get("device"),
            cfg.get("temperature"), tuple(cfg.get("studies") or ()))


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
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)          # atomic: a run killed while writing never leaves a truncated file
    return doc
