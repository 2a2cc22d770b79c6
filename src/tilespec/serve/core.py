"""The engine process: it owns the GPU, the engine (scheduler, K/V blocks, model runner, drafter) and the step loop,
and never waits on HTTP work.

The server's main process (serve/processes.py) starts it with an :class:`EngineSpec`, the inbox address (bound
here: every API process sends to it) and one outbox per API process. It loads the models (``spec.load``), sends
:class:`~tilespec.serve.messages.Loaded` (the tokenizer) on every outbox, builds the engine (serve.make_engine),
warms it up (serve/startup.py: the start-up and its timeline), answers :class:`~tilespec.serve.messages.Ready` on
every outbox, then loops: take every waiting message (submissions, cancellations, shutdown) without blocking while there is work, run
one ``engine.step()``, send each API process one :class:`~tilespec.serve.messages.Step` with its requests' new
tokens and the raw logprobs of those that asked (request id ``i`` belongs to API process ``i % count``). zmq sends
from its own I/O thread with no high-water mark, so a slow API process never stalls a step. When idle it blocks
on the inbox (100 ms at a time, checking that its parent lives). A step that raises ends the process with a
:class:`~tilespec.serve.messages.Failed`: the API process then fails every request in flight instead of hanging.

The process dies with its parent (Linux: PR_SET_PDEATHSIG; elsewhere the idle check of the parent's pid), so no
orphan keeps the GPU memory.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional

from .messages import (STATS_EVERY_S, Cancel, Failed, Loaded, Ready, Rejected, Shutdown, Step, Submit,
                       decode_to_engine, encode, split_by_process)


@dataclass
class EngineSpec:
    """What the engine process builds. ``load``: a picklable callable -> (target, draft, tokenizer), run in the engine
    process (the CLI loads by name there; a loaded CPU model passed to build_server is pickled across);
    ``options``: serve.make_engine's keywords; ``warmup``: compile and capture the step shapes before serving;
    ``hook``: a picklable callable given the built engine (tests slow or break its steps with it);
    ``send_tokenizer``: send the tokenizer in Loaded (the CLI's API process has none of its own); ``device``: where
    ``load`` puts the target, a name ("auto": CUDA where there is one; a CUDA device: its context is created beside
    the imports and the load); ``cpus``: the CPUs a CUDA engine's step loop keeps to itself once warm (serve/cpus.py:
    "auto", "none" or a CPU list)."""

    load: Callable[[], tuple]
    options: dict = field(default_factory=dict)
    warmup: bool = True
    hook: Optional[Callable] = None
    send_tokenizer: bool = True
    device: Optional[str] = None
    cpus: str = "auto"

    @contextmanager
    def portable(self):
        """While the spec is pickled for the engine process: transformers' output-capturing hooks (closures, which
        do not pickle; installed lazily on a model's first hidden-states call) are set aside with the flag that
        marks them installed, so the engine process installs its own."""
        load = self.load
        args = list(load.args) + list(load.keywords.values()) if isinstance(load, functools.partial) else []
        saved = [_set_aside_hooks(m) for m in _modules(args)]
        try:
            yield
        finally:
            for restore in saved:
                restore()


def _modules(values) -> list:
    torch = sys.modules.get("torch")
    if torch is None:       # nothing imported torch here, so no value is a model (the CLI's spec: names only)
        return []
    found = []
    for v in values:
        for x in (v if isinstance(v, (list, tuple)) else [v, getattr(v, "model", None)]):
            if isinstance(x, torch.nn.Module):
                found.append(x)
    return found


def _set_aside_hooks(model):
    taken, flagged = [], []
    for module in model.modules():
        if module.__dict__.pop("_output_capturing_hooks_installed", False):
            flagged.append(module)
        for key, hook in list(module._forward_hooks.items()):
            if "install_output_capuring_hook" in getattr(hook, "__qualname__", ""):   # transformers' spelling
                taken.append((module, key, hook, module._forward_hooks_with_kwargs.pop(key, None)))
                del module._forward_hooks[key]

    def restore():
        for module, key, hook, with_kwargs in taken:
            module._forward_hooks[key] = hook
            if with_kwargs is not None:
                module._forward_hooks_with_kwargs[key] = with_kwargs
        for module in flagged:
            module._output_capturing_hooks_installed = True
    return restore


def given(target, draft, tokenizer) -> tuple:
    """EngineSpec.load for models already loaded (pickled into the engine process). transformers learns which
    outputs a model class can record (hidden states for a head) when a model of the class is built; unpickled models
    were not built here, so their classes are registered again."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:         # a transformers without output capturing: nothing to register
        return target, draft, tokenizer
    for model in _modules([target, draft]):
        for module in model.modules():
            if getattr(module, "_can_record_outputs", None):
                _CAN_RECORD_REGISTRY[module] = module._can_record_outputs
    return target, draft, tokenizer


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def push_socket(ctx, address: str):
    """A PUSH socket connected to ``address`` that never blocks its sender (no high-water mark) and still delivers
    a last message (Failed) when its process exits."""
    import zmq
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(address)
    return sock


def run_engine(spec: EngineSpec, inbox: str, outboxes: list, parent: int) -> None:
    """The engine process's main (multiprocessing spawn target)."""
    _die_with_parent(parent)
    from .startup import build, engine_info, persistent_caches
    from .timeline import Marks
    marks = Marks()
    persistent_caches()
    import zmq
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(inbox)
    pushes = [push_socket(ctx, address) for address in outboxes]

    def close():
        for sock in (pull, *pushes):
            sock.close()
        ctx.term()

    def send_loaded(tokenizer: bytes) -> None:
        loaded = encode(Loaded(tokenizer=tokenizer))
        for push in pushes:
            push.send(loaded)
    try:
        engine, _, refused = build(spec, send_loaded, marks)
    except BaseException as err:        # a bad option, a failed load: the API process re-raises it
        failed = encode(Failed(error=f"{type(err).__name__}: {err}", kind=type(err).__name__))
        for push in pushes:
            push.send(failed)
        close()
        raise SystemExit(1) from err
    info = engine_info(engine, refused)
    info["engine_cpus"] = sorted(own_core(engine, spec.cpus))
    marks.mark("ready")
    ready = encode(Ready(info=dict(info, start_marks=marks.to_wire())))
    for push in pushes:
        push.send(ready)
    code = EngineLoop(engine, pull, pushes, parent).run()
    close()
    raise SystemExit(code)


def own_core(engine, choice: str) -> frozenset:
    """A CUDA engine's step loop (this thread) on a physical core of its own, every other thread of the process off
    it (serve/cpus.py says why); the CPUs reserved. Its torch ops on the host run on this thread alone: worker
    threads on the other, busy cores would make each parallel region wait for them."""
    from .cpus import engine_cpus, reserve
    device = getattr(engine, "device", None)
    if device is None or getattr(device, "type", str(device)) != "cuda":
        return frozenset()
    reserved = reserve(engine_cpus(choice))
    if reserved:
        import torch
        torch.set_num_threads(1)
    return reserved


def freeze_heap() -> None:
    """Move every object alive now (the models, the compiled graphs and their caches: millions of objects) out of
    the garbage collector's reach. Without this a full collection walks them all every few seconds of serving and
    stops the step loop for up to a second (seen on an H200: every stream stalled at once, the time to first token
    grew to 0.8 s at 64 clients); vLLM and SGLang freeze after start-up for the same reason."""
    gc.collect()
    gc.freeze()


class GCPauses:
    """Collections of the oldest generation and the seconds they took (gc.callbacks), for /metrics."""

    def __init__(self):
        self.count, self.seconds, self._t0 = 0, 0.0, 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._t0


def traced_graphs() -> int:
    """Graphs torch.compile traced in this process so far (0 where it never ran: its counters are not imported)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils.counters["stats"]["unique_graphs"] if utils is not None else 0


def engine_stats(engine, pauses: Optional[GCPauses] = None, traced: Optional[int] = None) -> dict:
    """Counters and gauges for /metrics (serve/metrics.py); ``traced``: :func:`traced_graphs` when serving began
    (a graph traced after it is a compile mid-traffic, which the warm-up exists to prevent)."""
    counters = dict(engine.counters)
    if pauses is not None:
        counters.update(gc_full_collections=pauses.count, gc_full_collection_seconds=pauses.seconds)
    if traced is not None:
        counters["graphs_traced_serving"] = traced_graphs() - traced
    stats = {"counters": counters, "running": engine.running, "waiting": len(engine.waiting),
             "max_batch": engine.max_batch}
    if hasattr(engine, "kv_bytes_in_use"):
        stats["kv_bytes_in_use"] = engine.kv_bytes_in_use()
    if getattr(engine, "switch", None) is not None:
        stats["drafting"] = {str(rows): int(entry["drafting"]) for rows, entry in engine.switch.state().items()}
    return stats


class EngineLoop:
    """Messages in, steps out (see the module docstring). ``ids``: engine rid -> the API's request id."""

    traced = None       # traced_graphs() when serving began

    def __init__(self, engine, pull, pushes: list, parent: int):
        self.engine, self.pull, self.pushes, self.parent = engine, pull, pushes, parent
        self.ids: dict = {}
        self.rids: dict = {}
        self.stats_at = 0.0
        self.dirty = True           # something changed since the last stats
        self.pauses = GCPauses()
        self.traced = traced_graphs()

    def run(self) -> int:
        import torch
        import zmq
        try:
            self._send([], force=True)      # the gauges exist from the first scrape on
            with torch.inference_mode():
                while True:
                    busy = self.engine.has_work
                    if self.pull.poll(0 if busy else 100):
                        if not self._take(zmq):
                            return 0
                    elif not busy:
                        if os.getppid() != self.parent:
                            return 0
                        self._send([], force=False)
                        continue
                    if self.engine.has_work:
                        self._step()
        except Exception as err:        # never leave the API's clients waiting on a dead engine
            failed = encode(Failed(error=f"{type(err).__name__}: {err}", kind=type(err).__name__))
            for push in self.pushes:
                push.send(failed)
            import traceback
            traceback.print_exc()
            return 1

    def _take(self, zmq) -> bool:
        """Every waiting message; False on Shutdown."""
        while True:
            try:
                msg = decode_to_engine(self.pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return True
            self.dirty = True
            if isinstance(msg, Submit):
                self._submit(msg)
            elif isinstance(msg, Cancel):
                for i in msg.ids:
                    rid = self.rids.pop(i, None)
                    if rid is not None:
                        self.ids.pop(rid, None)
                        self.engine.cancel(rid)
                self._send([], force=True)      # the cancellations show in the counters at once
            elif isinstance(msg, Shutdown):
                for rid in list(self.ids):
                    self.engine.cancel(rid)
                self._send([], force=True)
                return False

    def _submit(self, msg: Submit) -> None:
        try:
            rid = self.engine.submit(request_of(msg))
        except ValueError as err:
            self.pushes[msg.id % len(self.pushes)].send(encode(Rejected(id=msg.id, message=str(err))))
            return
        self.ids[rid], self.rids[msg.id] = msg.id, rid

    def _step(self) -> None:
        outputs, logprobs, prompts = [], None, None
        for event in self.engine.step():
            i = self.ids.get(event.rid)
            if i is None:
                continue
            outputs.append((i, event.tokens, event.finish_reason))
            if event.logprobs:          # only requests that asked carry them; their text is the API process's work
                logprobs = logprobs or {}
                logprobs[i] = event.logprobs
            if event.prompt_logprobs is not None:       # an echoing request's first event
                prompts = prompts or {}
                prompts[i] = event.prompt_logprobs
            if event.finish_reason is not None:
                del self.ids[event.rid]
                self.rids.pop(i, None)
        self.dirty = True
        self._send(outputs, force=not self.engine.has_work, logprobs=logprobs, prompts=prompts)    # idle: gauges now

    def _send(self, outputs: list, force: bool, logprobs: Optional[dict] = None, prompts: Optional[dict] = None):
        now = time.monotonic()
        stats = None
        if self.dirty and (force or now - self.stats_at >= STATS_EVERY_S):
            stats, self.stats_at, self.dirty = engine_stats(self.engine, self.pauses, self.traced), now, False
        n = len(self.pushes)
        if n == 1:
            if outputs or stats is not None:
                self.pushes[0].send(encode(Step(outputs, stats, logprobs, prompts)), copy=False)
            return
        parts: list = [[] for _ in range(n)]
        for out in outputs:
            parts[out[0] % n].append(out)
        for push, part, lp, pl in zip(self.pushes, parts, split_by_process(logprobs, n), split_by_process(prompts, n)):
            if part or stats is not None:
                push.send(encode(Step(part, stats, lp, pl)), copy=False)


def request_of(msg: Submit):
    """The engine's record of a submitted request."""
    from tilespec.engine.batch_request import BatchRequest
    from tilespec.verify.logit_settings import LogitSettings
    logits = None
    if msg.transforms:
        logits = LogitSettings(msg.presence_penalty, msg.frequency_penalty, dict(msg.logit_bias), msg.min_tokens)
    return BatchRequest(prompt=list(msg.prompt), max_tokens=msg.max_tokens, temperature=msg.temperature,
                        top_k=msg.top_k, top_p=msg.top_p, min_p=msg.min_p, seed=msg.seed, gamma=msg.gamma,
                        logits=logits, stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
                        logprobs=msg.logprobs, prompt_logprobs=msg.prompt_logprobs,
                        grammar=None if msg.grammar is None else tuple(msg.grammar))
