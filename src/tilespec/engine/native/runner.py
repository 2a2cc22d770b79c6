"""``NativeRunner``: the engine's model runner over a native decoder (engine/native/llama.py), eager or compiled.

Same contract as :class:`tilespec.engine.runner.ModelRunner` (forward / select / memory_bytes / capacity / mode):
``forward(tokens [B, q], positions [B, q], mask [B, 1, q, C] bool, write_slot)`` writes the q new K/V states at
slots [write_slot, write_slot + q) and returns fresh float32 logits [B, q or keep, V].

Modes:
  * "native": the native decoder eagerly (any device; the CPU tests check it token for token against transformers);
  * "native-graphs" (CUDA): decode/verify forwards run a ``torch.compile``d copy of the layer function (compiled
    once per model and shared by its layers; shapes become dynamic after the first change, so a new batch size, q
    or capacity costs at most one recompile) and are captured whole, with the mask conversion, in one CUDA graph
    per (B, q, C). Prefill (long, one per generation) runs the eager layer. Whisper's transformers encoder (eager, it
    is launch-bound) is captured in one CUDA graph per input shape and model.
Compiled code is cached across processes by inductor's own on-disk caches (FX graph and autotune caches, on by
default); :attr:`compile_seconds` records the time spent compiling in this process.
"""
from __future__ import annotations

import time
import types
import warnings
import weakref
from typing import Optional

import torch

from tilespec import settings

from ..cache import gather_buffer
from ..graphs import GraphCache
from .llama import NativeLlama, unsupported_reason
from .whisper import NativeWhisperDecoder, whisper_unsupported_reason

NATIVE_MODES = ("native", "native-graphs")
# parts of a Llama-family layer that run tilespec's decode-shape Triton kernels under "native-graphs"
# (llama.decoder_layer's ``kernels``; env TILESPEC_NATIVE_KERNELS overrides, "" = none). "attn": the split-KV
# attention in the shapes where it measures faster than cuDNN (attention.preferred: verify chains, large caches);
# "compact": a token tree's accepted K/V moved in every layer's buffers with one launch (native/slot_moves.py);
# "layer": a one-row step's layers as tilespec's kernels only (fused_layer.py: 1.51 against 1.77 ms for the
# Qwen2.5-1.5B shape on an H200, bench/results/forward-profile-qwen1.5b-shape-h200.json)
DEFAULT_KERNELS = "layer,attn,compact"


def active_kernel_parts() -> tuple:
    """The kernel parts in force for "native-graphs" runners: TILESPEC_NATIVE_KERNELS, else DEFAULT_KERNELS."""
    from .llama import _parts
    named = settings.get().native_kernels
    return _parts(DEFAULT_KERNELS if named is None else named)
_COMPILED_LAYERS: dict = {}


_ENCODER_GRAPHS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # model -> GraphCache or None


def encoder_forward(model, feats: torch.Tensor, graphs: bool) -> torch.Tensor:
    """The transformers encoder's last hidden state [B, T, d] for ``feats`` [B, mels, frames]; with ``graphs`` (CUDA)
    replayed from a CUDA graph per (model, shape), captured once per process (the encoder's weights never move).
    Returns a fresh tensor. A capture that fails falls back to the eager encoder for that model, with a warning."""
    encoder = model.get_encoder()
    cache = _ENCODER_GRAPHS.get(model, False) if graphs and feats.is_cuda else None
    if cache is False:
        cache = _ENCODER_GRAPHS[model] = GraphCache(lambda x, key=None: encoder(x).last_hidden_state, max_graphs=16)
    if cache is not None:
        try:
            return cache(feats).clone()
        except RuntimeError as err:   # e.g. a transformers version whose encoder syncs: stay correct, eagerly
            warnings.warn(f"capturing the encoder in a CUDA graph failed ({err}); running it eagerly")
            _ENCODER_GRAPHS[model] = None
            torch.cuda.synchronize(feats.device)
    return encoder(feats).last_hidden_state


def _cap(capture) -> dict:
    """The ``capture`` keyword for the native forward, only when asked (the Whisper decoder has none)."""
    return {"capture": tuple(capture)} if capture else {}


def _native_class(model):
    return NativeWhisperDecoder if type(model).__name__ == "WhisperForConditionalGeneration" else NativeLlama


def raise_recompile_limits(limit: int) -> None:
    """Let dynamo keep ``limit`` compiled variants per function (and 16× that in all): the engine's shapes
    (batch sizes, q, capacities) legitimately need more than its defaults."""
    cfg = torch._dynamo.config
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, knob):
            setattr(cfg, knob, max(getattr(cfg, knob), limit))
    for knob in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, knob):
            setattr(cfg, knob, max(getattr(cfg, knob), 16 * limit))


def native_reason(model) -> Optional[str]:
    """None when ``model`` can take the native path, else the reason it keeps the transformers modules."""
    if _native_class(model) is NativeWhisperDecoder:
        return whisper_unsupported_reason(model)
    return unsupported_reason(model)


def native_model(model):
    """The (cached) native decoder of ``model``: :class:`NativeLlama` or :class:`NativeWhisperDecoder`."""
    native = getattr(model, "_tilespec_native", None)
    if native is None:
        native = _native_class(model)(model)
        model._tilespec_native = native
    return native


def compiled_parts(model, dynamic: Optional[bool] = None) -> dict:
    """torch.compile'd copies of the native decoder's functions, private to ``model``: ``layer_fn`` always, and
    for Llama-family decoders ``prologue_fn`` (embedding, RoPE table, additive mask) and ``head_fn`` (final add,
    norm, LM head), which would otherwise run as ~15 eager kernels per forward.

    Why copies: dynamo keys its cache (and its automatic-dynamic bookkeeping) on the function's code object; a
    target and its draft have different hidden sizes, so sharing one code object would turn the hidden size into a
    dynamic dimension after the second model and slow every reduction. A renamed code object keeps them apart.
    ``dynamic=True``: copies compiled with every size symbolic (the prefill's: prompt lengths and capacities vary
    per generation, and a recompile per new length would land inside the timed decode).
    """
    key = (id(model), dynamic)
    entry = _COMPILED_LAYERS.get(key)
    if entry is None or entry[0]() is not model:
        native = native_model(model)
        raise_recompile_limits(64)
        names = {"layer_fn": "layer"} if native.encoder_decoder else \
            {"layer_fn": "layer", "prologue_fn": "prologue", "head_fn": "head"}
        fns = {kw: _private_compiled(getattr(native, attr), len(_COMPILED_LAYERS), dynamic)
               for kw, attr in names.items()}
        entry = (weakref.ref(model), fns)
        _COMPILED_LAYERS[key] = entry
    return entry[1]


def forget_compiled() -> None:
    """Drop every compiled copy and dynamo's caches: the next runner compiles again (benchmarks that switch a
    setting baked in at trace time, e.g. TILESPEC_NATIVE_KERNELS or TILESPEC_SDPA, between runs)."""
    torch._dynamo.reset()
    _COMPILED_LAYERS.clear()


def _private_compiled(fn, serial: int, dynamic: Optional[bool] = None):
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{serial}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return torch.compile(copy, dynamic=dynamic, fullgraph=True)


class NativeRunner:
    """One model's native decoder and KV caches for one (batch, capacity); see the module docstring."""

    def __init__(self, model, capacity: int, *, mode: str = "native", kernels: Optional[str] = None):
        if mode not in NATIVE_MODES:
            raise ValueError(f"mode must be one of {NATIVE_MODES}, got {mode!r}")
        if capacity <= 0:
            raise ValueError(f"cache capacity must be positive, got {capacity}")
        self.model = model
        self.native = native_model(model)
        self.device = self.native.embed.device
        self.dtype = self.native.dtype
        if mode == "native-graphs" and self.device.type != "cuda":
            raise ValueError("the native-graphs mode needs a CUDA device")
        self.mode = mode
        self.compiled = mode != "native"
        self.encdec = self.native.encoder_decoder
        self.encoder_out: Optional[torch.Tensor] = None
        self._capacity = capacity
        self.write_pos = torch.zeros((), dtype=torch.int64, device=self.device)
        self.caches: Optional[list] = None
        self.cache_version = 0          # bumped whenever the K/V buffers are replaced (captured graphs go stale)
        self.compile_seconds = 0.0
        self._graphs = GraphCache(self._graph_forward) if mode == "native-graphs" else None
        self._fns = compiled_parts(model) if mode == "native-graphs" else {}
        self._prefill: Optional[dict] = None
        # FlexAttention's decoding kernel (compiled only) is opt-in: tilespec.settings.configure(native_flex=True);
        # by default decode shapes run cuDNN SDPA
        self._layer_kw = {"flex": mode == "native-graphs" and settings.get().native_flex}
        if self.encdec:
            kernels = ""
        elif kernels is None:   # decode-shape Triton kernels (llama.decoder_layer's ``kernels``): graphs only
            native_kernels = settings.get().native_kernels
            kernels = (DEFAULT_KERNELS if native_kernels is None else native_kernels) if mode == "native-graphs" else ""
        if kernels:
            self._layer_kw["kernels"] = kernels

    @property
    def capacity(self) -> int:
        return self._capacity

    def _ensure_caches(self, batch: int) -> None:
        if self.caches is None or self.caches[0][0].shape[0] != batch:
            self.caches = self.native.new_caches(batch, self.capacity)
            self.cache_version += 1
            if self._graphs is not None:
                self._graphs.clear()           # captured graphs point at the old buffers

    def encode(self, input_features: torch.Tensor, shared: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Encoder-decoder models: run (or reuse) the transformers encoder once, input_features [B, mels, frames]
        -> [B, T, d], and project it to every layer's cross-attention K/V (copied into the existing buffers when
        the shapes repeat, so captured graphs stay valid)."""
        if not self.encdec:
            raise TypeError("encode() is only for encoder-decoder models")
        if shared is None:
            feats = input_features.to(self.device, self.dtype)
            t0, n = time.perf_counter(), len(_ENCODER_GRAPHS.get(self.model) or ())
            shared = encoder_forward(self.model, feats, graphs=self.mode == "native-graphs")
            if len(_ENCODER_GRAPHS.get(self.model) or ()) != n:    # a capture happened
                self.compile_seconds += time.perf_counter() - t0
        self.encoder_out = shared
        self._ensure_caches(shared.shape[0])
        cross = self.native.cross_states(shared)
        same = len(self.caches[0]) == 4 and self.caches[0][2].shape == cross[0][0].shape
        if same:
            for (_, _, ck, cv), (k, v) in zip(self.caches, cross):
                ck.copy_(k)
                cv.copy_(v)
        else:
            self.caches = [(k, v) + kv for (k, v, *_), kv in zip(self.caches, cross)]
            self.cache_version += 1
            if self._graphs is not None:
                self._graphs.clear()
        return shared

    def _graph_forward(self, tokens, positions, mask, key=None):
        return self.native.forward(tokens, positions, mask, self.write_pos, self.caches, **self._fns,
                                   **_cap(key), **self._layer_kw)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, write_slot: int,
                keep: Optional[int] = None, compiled: bool = True, capture: tuple = ()):
        """tokens/positions [B, q] int64, bool mask [B, 1, q, C] -> float32 logits [B, q or keep, V] (fresh).
        ``capture`` (hidden-state indices): returns (logits, features [B, q, n d]) instead (llama.NativeLlama)."""
        if capture and self.encdec:
            raise ValueError("hidden-state capture is for decoder-only models")
        b, q = tokens.shape
        if write_slot < 0 or write_slot + q > self.capacity:
            raise RuntimeError(f"cache overflow: writing {q} slots at {write_slot} into a capacity of {self.capacity}")
        if self.encdec and self.encoder_out is None:
            raise RuntimeError("call encode() before decoding an encoder-decoder model")
        self._ensure_caches(b)
        self.write_pos.fill_(write_slot)
        if compiled and self._graphs is not None:
            t0 = time.perf_counter()
            n = len(self._graphs)
            logits = self._graphs(tokens, positions, mask, key=tuple(capture) or None)
            if len(self._graphs) != n:         # a new shape: compile (maybe) + warm-up + capture happened
                self.compile_seconds += time.perf_counter() - t0
            feats = None
            if capture:
                logits, feats = logits[0], logits[1].clone()
            if keep is not None:
                logits = logits[:, -keep:]
            logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
            return logits if feats is None else (logits, feats)
        first = self._prefill is None
        fns = self._prefill_fns()
        if fns:
            try:
                t0 = time.perf_counter()
                out = self.native.forward(tokens, positions, mask, self.write_pos, self.caches, keep=keep, **fns,
                                          **_cap(capture), **self._layer_kw)
                if first:                      # compile (or a load from inductor's caches) + one run
                    self.compile_seconds += time.perf_counter() - t0
                return (out[0].float(), out[1]) if capture else out.float()
            except Exception as err:   # stay correct where a compile fails: eager from now on
                warnings.warn(f"compiled prefill failed ({type(err).__name__}: {err}); running it eagerly")
                self._prefill = {}
        eager_kw = {"kernels": self._layer_kw["kernels"]} if "kernels" in self._layer_kw else {}
        out = self.native.forward(tokens, positions, mask, self.write_pos, self.caches, keep=keep,
                                  **_cap(capture), **eager_kw)
        return (out[0].float(), out[1]) if capture else out.float()

    def _prefill_fns(self) -> dict:
        """Compiled (dynamic-shape) functions for forwards outside a graph (prefill) on "native-graphs", opt-in
        (``tilespec.settings.configure(compiled_prefill=True)``): ~13 kernels per layer instead of the eager layer's ~40 launches from
        Python (an eager prefill is launch-bound).
        Off by default: on CUDA with torch 2.11 dynamo failed on SDPA with fake tensors under dynamic shapes
        ("TypeError when making fake tensor call"), so every prefill fell back to eager after a wasted attempt.
        Empty elsewhere (eager native)."""
        if self._prefill is None:
            compiled = self.mode == "native-graphs" and settings.get().compiled_prefill
            self._prefill = compiled_parts(self.model, dynamic=True) if compiled else {}
        return self._prefill

    def raw_forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, write_pos: torch.Tensor,
                    keep: Optional[int] = None, capture: tuple = ()):
        """The forward without a graph of its own, for capture inside a larger one (engine/step_graph.py):
        ``write_pos`` a 0-d int64 device tensor; returns logits in the model dtype (a graph-owned buffer), or
        (logits, features) with ``capture``."""
        return self.native.forward(tokens, positions, mask, write_pos, self.caches, keep=keep, **self._fns,
                                   **_cap(capture), **self._layer_kw)

    def select(self, rows: torch.Tensor, slot_index: torch.Tensor) -> None:
        """Keep batch rows ``rows`` [B'] and move slots by ``slot_index`` [B', C] (as cache.gather_slots); the
        cross-attention K/V and the encoder output only lose rows."""
        if self.caches is None:
            return
        shrink = rows.shape[0] != self.caches[0][0].shape[0]
        new_caches = []
        for entry in self.caches:
            moved = []
            for j, buf in enumerate(entry):
                src = gather_buffer(buf, rows, slot_index) if j < 2 else buf.index_select(0, rows)
                if shrink:
                    moved.append(src)
                else:
                    buf.copy_(src)             # in place: captured graphs keep their addresses
                    moved.append(buf)
            new_caches.append(tuple(moved))
        self.caches = new_caches
        if shrink:
            if self.encoder_out is not None:
                self.encoder_out = self.encoder_out.index_select(0, rows)
            self.cache_version += 1
            if self._graphs is not None:
                self._graphs.clear()

    def memory_bytes(self) -> int:
        if self.caches is None:
            return 0
        return sum(t.numel() * t.element_size() for entry in self.caches for t in entry[:2])
