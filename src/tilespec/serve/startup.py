"""The engine process's start-up (serve/core.run_engine calls :func:`build`): load, build, warm up, with every phase
marked on the start-up timeline (serve/timeline.py), and the work that does not need the critical path moved beside
it:

  * CUDA's context is created on a thread while the main thread imports and loads (:func:`cuda_init`): torch
    releases the GIL inside the allocation that creates it, so the driver's work overlaps the imports;
  * the tokenizer goes to the API processes (Loaded) as soon as the models are loaded, so they unpickle it, build
    their apps and freeze their heaps while the engine warms up, and listen at once when it is ready;
  * the structured-output probe (xgrammar reading the vocabulary and compiling a JSON grammar: mostly C++, off the
    GIL) runs on a thread beside the warm-up, which touches neither the tokenizer nor the grammars.

Compile and autotune caches (TorchInductor, Triton) live under the tilespec home (:func:`persistent_caches`), so a
second start compiles nothing; what its warm-up still costs (tracing, loading cached kernels, captures) is in its
log line (engine/paged/warmup.py).
"""
from __future__ import annotations

import gc
import os
import pickle
import sys
import threading
import time
from typing import Callable, Optional

WARM_CONTEXT = 4096     # longer contexts capture their decode graphs when first met (rare; each once)


def log(*parts) -> None:
    """The engine process's start-up log: stderr, so that its stdout stays the parent's to read."""
    print(*parts, file=sys.stderr, flush=True)


def persistent_caches() -> None:
    """TorchInductor's and Triton's caches under the tilespec home (unless the user set them): warm second starts."""
    from tilespec.env import tilespec_home
    home = tilespec_home() / "compile-cache"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(home / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(home / "triton"))


class Beside(threading.Thread):
    """``fn()`` on a daemon thread; :meth:`result` joins it and returns its value (or raises its error);
    ``seconds``: how long it ran."""

    def __init__(self, name: str, fn: Callable):
        super().__init__(name=f"tilespec-{name}", daemon=True)
        self.fn, self.value, self.error, self.seconds = fn, None, None, 0.0
        self.start()

    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.value = self.fn()
        except BaseException as err:     # noqa: BLE001 - handed to the caller by result()
            self.error = err
        self.seconds = time.perf_counter() - t0

    def result(self):
        self.join()
        if self.error is not None:
            raise self.error
        return self.value


def cuda_init(device) -> Optional[Beside]:
    """CUDA's context for ``device`` (a CUDA device name, or "auto": CUDA where there is one), created on a thread;
    None for other devices. Without CUDA the thread does nothing: an explicit CUDA device's load then fails with its
    own message, "auto" loads on the CPU."""
    import torch
    auto = str(device) == "auto"
    if device is None or not auto and torch.device(device).type != "cuda":
        return None
    dev = torch.device("cuda" if auto else device)      # "auto": the device pick_device gives where CUDA is

    def init():
        if torch.cuda.is_available():       # the driver's initialisation, on this thread too
            torch.cuda.init()
            torch.zeros(1, device=dev)      # the first allocation creates the context (the GIL released meanwhile)
    return Beside("cuda-init", init)


def build(spec, send_loaded: Callable[[bytes], None], marks) -> tuple:
    """(engine, tokenizer, its :func:`refusals`) from ``spec`` (serve/core.EngineSpec); ``send_loaded(pickled
    tokenizer or b"")`` is called once the models are loaded; ``marks``: this process's timeline
    (serve/timeline.Marks)."""
    import torch

    from tilespec.models import loading

    from . import make_engine
    cuda = cuda_init(spec.device)
    marks.mark("imports")
    loading.LOAD_TIMES.clear()
    target, draft, tokenizer = spec.load()
    parts = ", ".join(f"{k} {v:.1f} s" if isinstance(v, float) else f"{k} {v}" for k, v in loading.LOAD_TIMES.items())
    marks.mark(f"load ({parts})" if parts else "load")
    if cuda is not None:
        cuda.result()
        marks.spans["CUDA init"] = cuda.seconds
    inner = getattr(tokenizer, "tokenizer", tokenizer)
    send_loaded(pickle.dumps(inner) if spec.send_tokenizer else b"")
    marks.mark("tokenizer sent")
    pad = getattr(inner, "pad_token_id", None)
    engine = make_engine(target, draft, tokenizer=inner, pad_token_id=pad if pad is not None else 0, **spec.options)
    marks.mark("engine")
    probe = probe_beside(engine)
    if spec.warmup:
        with torch.inference_mode():
            if hasattr(engine, "warm_up"):      # the paged engine: decode graphs for contexts up to WARM_CONTEXT
                engine.warm_up(max_context=min(engine.max_len, WARM_CONTEXT), log=log)
            else:
                from tilespec.engine.batch_warmup import warm_up
                warm_up(engine, log=log)
    if spec.hook is not None:
        spec.hook(engine)
    marks.mark("warm-up")
    refused = probe.result()
    marks.spans["grammar probe"] = probe.seconds
    marks.mark("probe joined")
    from .core import freeze_heap
    freeze_heap()
    marks.mark("gc freeze")
    _log_phases(marks)
    return engine, inner, refused


def _log_phases(marks) -> None:
    """``engine start: load 9.7 s, engine 0.9 s, ...``: each phase's own seconds (bench/gpu/run.sh greps it)."""
    steps = [(name.split(" (")[0], b - a) for (_, a), (name, b) in zip(marks.marks, marks.marks[1:])]
    beside = "".join(f", {name} {s:.1f} s beside" for name, s in marks.spans.items())
    log("engine start: " + ", ".join(f"{name} {s:.1f} s" for name, s in steps) + beside)


def probe_beside(engine) -> Beside:
    """The probes of :func:`refusals` on a thread. xgrammar is imported here first: an import on the thread
    while the warm-up imports the compiler could deadlock on the import locks."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        pass
    return Beside("probe", lambda: refusals(engine))


def refusals(engine) -> dict:
    """Why ``engine`` refuses logprobs and grammars (None: it serves them)."""
    return {"logprobs_refused": _refused(engine, logprobs=0, prompt_logprobs=0),
            "grammar_refused": _refused(engine, grammar=("json_object", ""))}


def engine_info(engine, refused: Optional[dict] = None) -> dict:
    """What the API process needs: limits to check requests with, and what the start-up log line reports;
    ``refused``: :func:`refusals` when already asked."""
    info = {"engine": type(engine).__name__, "max_len": engine.max_len, "max_request_len": engine.max_request_len,
            "vocab": engine.vocab, "max_batch": engine.max_batch, "gamma": engine.gamma,
            "gc_frozen_objects": gc.get_freeze_count()}
    info["drafter"] = getattr(getattr(engine, "drafter", None), "name", None)
    info.update(refusals(engine) if refused is None else refused)
    if hasattr(engine, "capacity_tokens"):
        info["kv_capacity_tokens"] = engine.capacity_tokens
        info["kv_bytes"] = engine.model.memory_bytes()
    return info


def _refused(engine, **fields) -> Optional[str]:
    """Why ``engine`` cannot serve a request with ``fields`` (logprobs, a grammar: its own check's message; None when
    it can). Asked once here so that the API process refuses such a request with a 400 before it is accepted, not
    with an error mid-stream. Any other error the probe meets (a tokenizer xgrammar cannot read) refuses too,
    rather than failing the start of a server that may never see such a request."""
    from tilespec.engine.batch_request import BatchRequest
    check = getattr(engine, "check", None)
    if check is None:
        return None
    try:
        check(BatchRequest(prompt=[0], max_tokens=1, **fields))
    except ValueError as err:
        return str(err)
    except Exception as err:        # noqa: BLE001 - reported as the reason, per request, instead
        return f"{type(err).__name__}: {err}"
    return None
