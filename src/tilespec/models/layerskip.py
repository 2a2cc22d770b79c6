"""Layer-skip self-speculative drafts (Draft & Verify style): the first N decoder layers of a target, plus its final
norm and LM head, as an ordinary transformers model that *shares* the target's modules (no weight copy).

``layer_skip_draft(target, n)`` returns a model of the target's own class whose config says ``n`` decoder layers:

* causal LMs (``XForCausalLM`` with ``.model.layers``, e.g. Qwen2, Llama): ``draft(input_ids, past_key_values=...,
  use_cache=True)`` and ``draft.generate(...)`` work as for any causal LM; logits are ``[batch, seq, vocab]`` with
  the target's vocabulary, computed as ``lm_head(norm(layer_{n-1}(... layer_0(embed(ids)))))``.
* Whisper (``WhisperForConditionalGeneration``): the encoder *module* is shared too, so
  ``draft(encoder_outputs=target_encoder_out, decoder_input_ids=..., past_key_values=EncoderDecoderCache(...),
  use_cache=True)`` reuses the target's encoder output; only the first ``n`` decoder layers run.

Invariants: every parameter of the draft *is* (same storage) a parameter of the target; ``n == all layers`` gives
logits identical to the target's; the draft's KV cache has ``n`` layers and is not interchangeable with the
target's. Moving/casting the target moves/casts the draft (and vice versa).
"""
from __future__ import annotations

import copy

import torch
from torch import nn


def _decoder_stack(model) -> tuple[nn.Module, str]:
    """(module holding ``layers``, config attribute for its layer count) of a causal LM or Whisper model."""
    if getattr(getattr(model, "config", None), "model_type", None) == "whisper":
        return model.model.decoder, "decoder_layers"
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        raise ValueError(f"{type(model).__name__} is not a supported target: expected `.model.layers` "
                         "(a decoder-only causal LM) or a WhisperForConditionalGeneration")
    return inner, "num_hidden_layers"


def num_decoder_layers(model) -> int:
    """Number of decoder layers of a causal LM or Whisper model."""
    return len(_decoder_stack(model)[0].layers)


def _share_children(dst: nn.Module, src: nn.Module, skip: tuple[str, ...] = ()) -> None:
    for name, child in src.named_children():
        if name not in skip:
            setattr(dst, name, child)


def layer_skip_draft(target: nn.Module, layers: int) -> nn.Module:
    """A draft running the first ``layers`` decoder layers of ``target`` (1 <= layers <= total), sharing weights."""
    stack, attr = _decoder_stack(target)
    total = len(stack.layers)
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= total:
        raise ValueError(f"layers must be an int in [1, {total}] for {type(target).__name__}, got {layers!r}")
    cfg = copy.deepcopy(target.config)
    setattr(cfg, attr, layers)
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:layers]
    with torch.device("meta"):
        draft = type(target)(cfg)
    d_stack, _ = _decoder_stack(draft)
    _share_children(d_stack, stack, skip=("layers",))
    d_stack.layers = nn.ModuleList(list(stack.layers)[:layers])
    if attr == "decoder_layers":      # Whisper: share the encoder and everything else of model.model
        _share_children(draft.model, target.model, skip=("decoder",))
    _share_children(draft, target, skip=("model",))
    left = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"layer-skip draft of {type(target).__name__} left unshared tensors: {left[:5]}")
    draft.generation_config = copy.deepcopy(target.generation_config)
    draft.tilespec_layerskip = (layers, total)
    draft.train(target.training)
    return draft


def shares_weights(draft: nn.Module, target: nn.Module) -> bool:
    """True when every parameter of ``draft`` is stored in a parameter of ``target``."""
    ptrs = {p.data_ptr() for p in target.parameters()}
    return all(p.data_ptr() in ptrs for p in draft.parameters())
