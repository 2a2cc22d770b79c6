"""A uniform forward over Hugging Face models for the engine: decoder-only causal LMs and Whisper's decoder.

``ModelRunner.forward(tokens [B, q], positions [B, q], mask [B, 1, q, C], write_slot)`` writes the q new K/V states
at slots [write_slot, write_slot + q) of the runner's :class:`SlotCache` and returns float logits [B, q, V] (only the
last ``keep`` rows when asked). The bool mask (True = attend, from :func:`tilespec.engine.state.chunk_mask`) becomes
an additive mask in the model's own dtype (0 / finfo.min: never -inf, so fully masked padding rows stay finite);
transformers returns a 4-D mask as it is, so holes and left padding need no model-specific code. Positions are
explicit per request (RoPE or learned embeddings).

Whisper: the encoder runs once (:meth:`encode`); the cross-attention K/V are computed on the first decoder call and
kept in the ``EncoderDecoderCache``; a draft derived from the target (same encoder weights) reuses its encoder output.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from tilespec.models.cache_keyword import cache_kwarg

from .cache import SlotCache, gather_slots
from .graphs import GraphCache
from .native.runner import NATIVE_MODES, NativeRunner, native_reason, raise_recompile_limits


GRAPH_MODES = ("graphs", "compiled-graphs")
CUDA_GRAPH_MODES = GRAPH_MODES + ("native-graphs",)   # every mode that replays forwards as CUDA graphs


def step_mode(compile: bool | str, device: torch.device, model=None) -> str:
    """How a runner executes decode/verify forwards: "eager", "graphs", "compiled-graphs", "native",
    "native-graphs" or "compile".

    compile=False -> eager (the transformers modules); True -> on CUDA "native-graphs" when ``model`` is a supported
    Llama-family model (engine/native: compiled layer function, whole forward in one CUDA graph) and "graphs"
    otherwise, eager elsewhere; "graphs" -> the transformers modules' eager kernels captured in CUDA graphs (encoder-decoders: the native
    decoder instead, "native-graphs");
    "compiled-graphs" -> their attention-free parts compiled, then captured (experimental); "native" -> the native
    decoder eagerly (any device); "native-graphs" -> the native decoder compiled and captured (CUDA); "debug" or a
    torch.compile mode string ("reduce-overhead", "max-autotune", ...) -> torch.compile of the whole forward.
    """
    if compile is False or compile is None:
        return "eager"
    if compile is True:
        if device.type != "cuda":
            return "eager"
        return "native-graphs" if model is not None and native_reason(model) is None else "graphs"
    if compile in GRAPH_MODES or compile == "native-graphs":
        if device.type != "cuda":
            raise ValueError(f"compile={compile!r} needs a CUDA device")
        if compile in GRAPH_MODES and model is not None and is_encoder_decoder(model):
            # capturing transformers' Whisper decoder fails on the GPU (transformers 5.17: the capture is
            # invalidated inside its attention); the native decoder is the captured path for encoder-decoders
            if native_reason(model) is None:
                return "native-graphs"
            raise ValueError(f"compile={compile!r}: CUDA graphs of transformers' encoder-decoder modules are not "
                             f"supported ({type(model).__name__}); use compile=False")
        return compile
    if compile == "native":
        return compile
    if not isinstance(compile, str):
        raise TypeError(f"compile must be a bool or a string, got {compile!r}")
    return "compile"


def make_runner(model, capacity: int, *, compile: bool | str = False):
    """The runner for ``model``: a :class:`NativeRunner` for the native modes, else a :class:`ModelRunner`.

    compile="native"/"native-graphs" on a model the native path does not support raises (say which path you want);
    compile=True picks the native path only where it is supported.
    """
    mode = step_mode(compile, next(model.parameters()).device, model)
    if getattr(model, "_tilespec_tp", None) is not None and mode not in NATIVE_MODES:
        if mode != "eager":   # a sharded model has only its native decoder (engine/native/tensor_parallel.py)
            raise ValueError(f"compile={compile!r}: a tensor-parallel model runs on the native runtime; use "
                             "compile=True, 'native-graphs' or 'native' (False runs 'native' too)")
        mode = "native"
    if mode in NATIVE_MODES:
        reason = native_reason(model)
        if reason is not None:
            raise ValueError(f"compile={compile!r}: no native path for {type(model).__name__} ({reason}); "
                             "use compile=True or 'graphs'")
        return NativeRunner(model, capacity, mode=mode)
    return ModelRunner(model, capacity, compile=compile)


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder's layer list (``model.get_decoder().layers``): Llama/Qwen/Gemma families and Whisper."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(dec, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (expected get_decoder().layers)")
    return layers


def _attention_free_parts(model) -> list:
    """The decoder's modules that never touch the KV cache: every child of a decoder layer that is not (and holds
    no) attention module (norms, MLP), plus the decoder's own final norm and rotary-embedding modules."""
    def touches_cache(module) -> bool:  # attention modules find their cache layer through ``layer_idx``
        return any(hasattr(m, "layer_idx") for m in module.modules())

    dec = model.get_decoder()
    parts = [child for layer in decoder_layers(model) for child in layer.children() if not touches_cache(child)]
    parts += [child for name, child in dec.named_children()
              if ("norm" in name or "rotary" in name) and not isinstance(child, torch.nn.ModuleList)]
    return parts


def compile_decoder_layers(model, backend: str = "inductor") -> int:
    """torch.compile, in place, the attention-free parts of every decoder layer (norms, MLP) and the final norm /
    rotary embedding; returns how many modules were newly compiled.

    Why not whole layers: a layer reaches its KV cache through its integer ``layer_idx``, which dynamo specialises
    on, so whole-layer compilation recompiles once per layer and per shape (minutes for a 28-layer model). The
    attention-free parts are identical across layers and have no such attribute: they compile once per module type
    (shapes turn dynamic after the first change, dynamic=None) in seconds, and fuse the ~7 kernels of an eager
    RMSNorm and the activation-times-gate of a gated MLP, which is most of what a CUDA-graph replay of an eager
    decoder spends its time on (it is bound by the number of kernels, not by bandwidth).
    Other users of the same model object get the compiled modules too; :func:`uncompile_decoder_layers` undoes it.
    """
    raise_recompile_limits(64)
    n = 0
    for part in _attention_free_parts(model):
        if getattr(part, "_compiled_call_impl", None) is None:
            part.compile(backend=backend, dynamic=None)
            n += 1
    return n


def uncompile_decoder_layers(model) -> None:
    """Undo :func:`compile_decoder_layers` (the compiled code stays in dynamo's cache for the next time)."""
    for part in _attention_free_parts(model):
        part._compiled_call_impl = None


def is_encoder_decoder(model) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def shares_encoder(a, b) -> bool:
    """True when two encoder-decoder models use the very same encoder weights (a layer-skip draft of a target)."""
    try:
        pa = next(a.get_encoder().parameters())
        pb = next(b.get_encoder().parameters())
    except (AttributeError, StopIteration):
        return False
    return pa.data_ptr() == pb.data_ptr() or (pa.shape == pb.shape and torch.equal(pa, pb))


class ModelRunner:
    """Owns one model's slot cache for one generation; optionally graphs or compiles the decode/verify forward.

    compile: see :func:`step_mode`. "graphs" captures one CUDA graph per (batch, q, capacity) on first use (a few
        ms each) and replays it; "debug" runs dynamo with the eager backend (exercises tracing quickly on CPU).
    """

    def __init__(self, model, capacity: int, *, compile: bool | str = False):
        if not hasattr(model, "config"):
            raise TypeError(f"expected a Hugging Face model, got {type(model).__name__}")
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.encdec = is_encoder_decoder(model)
        self.cache = SlotCache(capacity, self.device)
        self.past = EncoderDecoderCache(self.cache, DynamicCache()) if self.encdec else self.cache
        self.encoder_out: Optional[torch.Tensor] = None
        self._step = self._forward
        self.mode = step_mode(compile, self.device, model)
        if self.mode in NATIVE_MODES:   # True on CUDA picks native for supported models: make_runner builds those
            self.mode = "graphs"
        self.compiled = self.mode != "eager"
        if self.mode in GRAPH_MODES:
            if self.mode == "compiled-graphs":
                compile_decoder_layers(model)
            self._step = GraphCache(self._graph_forward)
        elif self.mode == "compile":
            mode = str(compile)
            # one graph per (batch size, q in {1, 2, γ+1}); adaptive γ and shrinking batches need more than 8
            raise_recompile_limits(64)
            torch._dynamo.mark_static_address(self.cache.write_pos)
            if compile == "debug":
                self._step = torch.compile(self._forward, backend="eager", dynamic=False)
            else:
                self._step = torch.compile(self._forward, mode=mode, dynamic=False)

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def encode(self, input_features: torch.Tensor, shared: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run (or reuse) the encoder once: input_features [B, mels, frames] -> hidden states [B, T, d]."""
        if not self.encdec:
            raise TypeError("encode() is only for encoder-decoder models")
        if shared is not None:
            self.encoder_out = shared
        else:
            feats = input_features.to(self.device, self.dtype)
            self.encoder_out = self.model.get_encoder()(feats).last_hidden_state
        return self.encoder_out

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """tokens/positions [B, q], bool mask [B, 1, q, C] -> logits [B, q, V] in the model's dtype."""
        additive = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device)
        additive.masked_fill_(~mask, torch.finfo(self.dtype).min)
        past = {cache_kwarg(self.model): self.past}
        if self.encdec:
            out = self.model(encoder_outputs=(self.encoder_out,), decoder_input_ids=tokens,
                             decoder_position_ids=positions, decoder_attention_mask=additive, use_cache=True, **past)
        else:
            out = self.model(input_ids=tokens, position_ids=positions, attention_mask=additive, use_cache=True,
                             **past)
        return out.logits

    def _graph_forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, key=None):
        return self._forward(tokens, positions, mask).float()

    def _features(self, tokens, positions, mask, capture: tuple):
        """The eager forward with transformers' ``output_hidden_states``: (logits, features [B, q, n d])."""
        additive = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device)
        additive.masked_fill_(~mask, torch.finfo(self.dtype).min)
        out = self.model(input_ids=tokens, position_ids=positions, attention_mask=additive, use_cache=True,
                         output_hidden_states=True, **{cache_kwarg(self.model): self.past})
        return out.logits, torch.cat([out.hidden_states[i] for i in capture], dim=-1)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, write_slot: int,
                keep: Optional[int] = None, compiled: bool = True, capture: tuple = ()):
        """tokens/positions [B, q] int64, mask [B, 1, q, C] -> float logits [B, q or keep, V] (a fresh tensor).
        ``capture``: hidden-state indices (transformers' ``hidden_states``) -> (logits, features [B, q, n d]);
        eager runners of decoder-only models only."""
        if write_slot < 0 or write_slot + tokens.shape[1] > self.capacity:
            raise RuntimeError(f"cache overflow: writing {tokens.shape[1]} slots at {write_slot} "
                               f"into a capacity of {self.capacity}")
        if self.encdec and self.encoder_out is None:
            raise RuntimeError("call encode() before decoding an encoder-decoder model")
        self.cache.seek(write_slot)
        if capture:
            if self.encdec or self.mode != "eager":
                raise ValueError(f"hidden-state capture (a draft head) needs an eager runner of a decoder-only model "
                                 f"or the native runtime (compile=True / 'native'), not mode {self.mode!r}")
            logits, feats = self._features(tokens, positions, mask, tuple(capture))
            return (logits[:, -keep:] if keep is not None else logits).float(), feats
        step = self._step if compiled else self._forward
        logits = step(tokens, positions, mask)
        if keep is not None:
            logits = logits[:, -keep:]
        if logits.dtype == torch.float32:
            return logits.clone()  # a CUDA-graph output buffer is overwritten by the next replay
        return logits.float()

    def select(self, rows: torch.Tensor, slot_index: torch.Tensor) -> None:
        """Keep batch rows ``rows`` [B'] and move slots by ``slot_index`` [B', C] (see cache.gather_slots)."""
        gather_slots([self.cache], rows, slot_index)
        if self.encdec:
            cross = self.past.cross_attention_cache
            for layer in cross.layers:
                if getattr(layer, "is_initialized", False) and layer.keys.shape[0] != rows.shape[0]:
                    layer.keys = layer.keys.index_select(0, rows)
                    layer.values = layer.values.index_select(0, rows)
            if self.encoder_out is not None and self.encoder_out.shape[0] != rows.shape[0]:
                self.encoder_out = self.encoder_out.index_select(0, rows)

    def memory_bytes(self) -> int:
        return self.cache.nbytes()
