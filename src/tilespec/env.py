"""The machine tilespec runs on: its home and data folders, device/dtype picking, Triton's interpreter switch and
the run record every benchmark / evaluation JSON carries. Environment variables are read by
:mod:`tilespec.settings` only.

Folders:
  * ``tilespec_home()``: ``$TILESPEC_HOME`` or ``~/.cache/tilespec`` (model cache, fetched wheels, derived data).
  * ``data_root()``: evaluation data that cannot be fetched from a package index (CNN/DM, LJSpeech clips):
    ``$TILESPEC_DATA`` or ``tilespec_home()/data``. Library code names no other path.
Device and dtype: ``pick_device("auto")`` is CUDA when available, else CPU; ``pick_dtype("auto", device)`` is bf16 on
a GPU and fp32 on CPU, for generation, transcription, evaluation and benchmarks alike.
"""
from __future__ import annotations

import datetime
import functools
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

from . import settings

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def tilespec_home() -> Path:
    """``$TILESPEC_HOME`` or ``~/.cache/tilespec`` (:mod:`tilespec.settings`)."""
    return settings.get().home


def data_root() -> Path:
    """The evaluation data folder: ``$TILESPEC_DATA`` or ``tilespec_home()/data`` (:mod:`tilespec.settings`)."""
    return settings.get().data


def use_triton_interpreter_without_cuda() -> None:
    """Without CUDA, Triton kernels can only run in Triton's interpreter; Triton reads ``TRITON_INTERPRET`` when it
    is first imported (transformers may import it early), so ``import tilespec`` calls this before anything else.
    An explicit setting is kept. Before torch is imported the question waits for Triton's import
    (:class:`_BeforeTriton`): ``import tilespec`` stays free of torch (``tilespec serve`` starts its engine process
    sooner)."""
    if "torch" not in sys.modules and "triton" not in sys.modules:
        if not any(isinstance(f, _BeforeTriton) for f in sys.meta_path):
            sys.meta_path.insert(0, _BeforeTriton())
        return
    _decide_interpreter()


def cache_bytecode_in_home() -> None:
    """Compiled bytecode under ``tilespec_home()/pycache`` when Python cannot write it beside the installed sources
    (a read-only site-packages) or is told not to (``PYTHONDONTWRITEBYTECODE``, common in container images): then
    every process compiles the ~900 modules that torch and transformers import from source at every start (3.0 s of
    a 6-8 s config load in `tilespec serve`'s engine process on one H200 host, and as much in each API process:
    bench/results/engine-load-profile-h200.json). ``import tilespec`` calls this before torch is imported; the
    processes it spawns inherit the folder (``PYTHONPYCACHEPREFIX``). An explicit ``PYTHONPYCACHEPREFIX`` is kept."""
    if sys.pycache_prefix is not None:
        return
    spec = importlib.util.find_spec("torch")        # finds, does not import
    if spec is None or spec.origin is None:
        return
    beside = Path(spec.origin).parent / "__pycache__"
    if not sys.flags.dont_write_bytecode and os.access(beside if beside.exists() else beside.parent, os.W_OK):
        return
    try:        # a bad TILESPEC_* value is reported where it is used, not by ``import tilespec``
        prefix = settings.get().home / "pycache"
        prefix.mkdir(parents=True, exist_ok=True)
    except (ValueError, OSError):
        return
    sys.pycache_prefix, sys.dont_write_bytecode = str(prefix), False
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def _decide_interpreter() -> None:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


class _BeforeTriton:
    """An import finder that answers nothing: when ``triton`` is first looked up it removes itself and decides
    ``TRITON_INTERPRET`` (importing torch, which does not import triton), then the ordinary finders import it."""

    def find_spec(self, name, path=None, target=None):
        if name == "triton":
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _decide_interpreter()
        return None


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether Triton (the GPU kernels' compiler) is installed."""
    return importlib.util.find_spec("triton") is not None


def pick_device(name="auto"):
    """"auto" -> cuda when available, else cpu; other names are checked (cuda without CUDA is an error)."""
    import torch
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but CUDA is not available; use device='cpu' or 'auto'")
    return dev


def pick_dtype(name="auto", device=None):
    """"auto" -> bfloat16 on a GPU, float32 on CPU; names float32/fp32, bfloat16/bf16, float16/fp16; a
    torch.dtype is returned as it is."""
    import torch
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if device is not None and torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose float32, bfloat16 or float16 (or auto)")
    return getattr(torch, DTYPES[name])


def git_commit(short: bool = False) -> str | None:
    """``$TILESPEC_COMMIT`` when set (a copy of a working tree, e.g. on a GPU machine, may carry a stale .git),
    else the commit of the checkout tilespec runs from, else None."""
    pinned = settings.get().commit
    if pinned:
        return f"{pinned} (from TILESPEC_COMMIT)"
    try:
        args = ["git", "rev-parse"] + (["--short"] if short else []) + ["HEAD"]
        commit = subprocess.run(args, capture_output=True, text=True, timeout=10,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return commit


def versions(*extra: str) -> dict:
    """python, torch, triton, transformers (and any ``extra`` module) versions; a missing module reads None."""
    import importlib
    out = {"python": platform.python_version()}
    for mod in ("torch", "triton", "transformers") + extra:
        try:
            out[mod] = importlib.import_module(mod).__version__
        except Exception:  # noqa: BLE001  (an optional module may fail in many ways; record it as absent)
            out[mod] = None
    return out


def device_name(device) -> str:
    """The GPU's name, or a CPU description with its thread count."""
    import torch
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def host_record() -> dict:
    """The host CPU as a serving benchmark needs it: its model, core count and ``host_loop_us``, the best of five
    timings of a fixed pure-Python loop. An engine at high load is host-bound, so the same code measured 1.6x apart
    on two H200 machines of one kind (every host phase of the step alike); this says which host a number came from."""
    import time
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        cpu = None

    def loop() -> float:
        t0, acc = time.perf_counter(), 0
        for i in range(200_000):
            acc += i & 7
        return time.perf_counter() - t0
    return {"cpu": cpu or platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "host_loop_us": round(1e6 * min(loop() for _ in range(5)), 1)}


def run_record(device=None, *extra_modules: str, short_commit: bool = False) -> dict:
    """What every results JSON records, flat: device, python/torch/triton/transformers (+ ``extra_modules``)
    versions, commit, date (UTC, ISO), platform, triton_interpret, the host (:func:`host_record`), and cuda on a
    GPU."""
    import torch
    device = torch.device(device) if device is not None else pick_device()
    rec = dict(device=device_name(device), **versions(*extra_modules), commit=git_commit(short_commit),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               platform=platform.platform(), triton_interpret=triton_interpreted(), **host_record())
    if device.type == "cuda":
        rec["cuda"] = torch.version.cuda
    return rec
