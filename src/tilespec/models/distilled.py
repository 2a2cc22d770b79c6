"""The architecture of a Distil-Whisper-style draft for a Whisper target: :func:`student`.

``student(target, layers)`` returns a model of the target's class whose config has ``len(layers)`` decoder layers,
holding *copies* of the target's decoder layers at ``layers`` (Distil-Whisper initialises from the first and the
last) and of its final decoder layer norm -- the trainable part -- while the encoder, the token and position
embeddings and the LM head (tied to the embeddings) are the target's own modules (shared storage, frozen). Because
the encoder is shared, the engine reuses the target's encoder output for the draft (``runner.shares_encoder``); the
copied layers keep their own cross-attention K/V projections, computed once per generation from that output.

Training lives in ``tilespec.training`` (whisper_draft.py); saving and loading trained copies in
``tilespec.heads.distilled``. Invariants: the draft's parameters outside ``trainable(draft)`` *are* the target's;
``draft.tilespec_distilled == {"layers": [...], "total": N}``.
"""
from __future__ import annotations

import copy
from typing import Optional, Sequence

import torch
from torch import nn

FUSED_CACHE = "_tilespec_fused"     # the native runtime's per-layer fused weights (engine/native/whisper.py)


def whisper_decoder(target) -> nn.Module:
    """The decoder stack of a WhisperForConditionalGeneration; ValueError for anything else."""
    if getattr(getattr(target, "config", None), "model_type", None) != "whisper":
        raise ValueError(f"a distilled Whisper draft needs a WhisperForConditionalGeneration, got "
                         f"{type(target).__name__}")
    return target.model.decoder


def forget_fused(module: nn.Module) -> None:
    """Drop the native runtime's cached fused weights under ``module`` (stale once its weights change)."""
    for m in module.modules():
        if hasattr(m, FUSED_CACHE):
            delattr(m, FUSED_CACHE)


def student(target, layers: Optional[Sequence[int]] = None) -> nn.Module:
    """The draft: copies of the target's decoder layers ``layers`` (default: first and last) and final norm, the
    rest shared with ``target``. Raises ValueError for a non-Whisper target or layer indices out of range."""
    stack = whisper_decoder(target)
    total = len(stack.layers)
    layers = tuple(layers) if layers is not None else (0, total - 1)
    if not layers or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < total for i in layers):
        raise ValueError(f"layers must be indices in [0, {total}) of {type(target).__name__}'s decoder, got {layers!r}")
    cfg = copy.deepcopy(target.config)
    cfg.decoder_layers = len(layers)
    with torch.device("meta"):
        draft = type(target)(cfg)
    for name, child in stack.named_children():
        if name not in ("layers", "layer_norm"):
            setattr(draft.model.decoder, name, child)
    copies = [copy.deepcopy(stack.layers[i]) for i in layers]
    for j, layer in enumerate(copies):          # the draft's cache has len(layers) layers
        for attn in (layer.self_attn, layer.encoder_attn):
            attn.layer_idx = j
    draft.model.decoder.layers = nn.ModuleList(copies)
    draft.model.decoder.layer_norm = copy.deepcopy(stack.layer_norm)
    forget_fused(draft.model.decoder.layers)    # a copy of the target's cache would outlive training
    _own_storage(draft.model.decoder.layers)
    _own_storage(draft.model.decoder.layer_norm)
    draft.model.encoder = target.model.encoder
    draft.proj_out = target.proj_out
    left = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"distilled draft of {type(target).__name__} left unbuilt tensors: {left[:5]}")
    draft.generation_config = copy.deepcopy(target.generation_config)
    draft.tilespec_distilled = {"layers": list(layers), "total": total}
    draft.tilespec_role = "draft"
    return draft.train(target.training)


def _own_storage(module: nn.Module) -> None:
    """Give every parameter of ``module`` a fresh ordinary tensor: the native runtime re-points a model's q/k/v weights
    into fused tensors made under inference mode, which a copy would inherit and then could not train or load."""
    for m in module.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            setattr(m, name, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))


def trainable(draft) -> list:
    """The draft's own parameters (decoder layer copies and final norm): the ones training changes and saving keeps."""
    return [*draft.model.decoder.layers.parameters(), *draft.model.decoder.layer_norm.parameters()]


def own_state(draft) -> dict:
    """``{name: tensor}`` of the draft's own weights (decoder layer copies and final norm), as saved."""
    dec = draft.model.decoder
    out = {f"layers.{k}": v for k, v in dec.layers.state_dict().items()}
    out.update({f"layer_norm.{k}": v for k, v in dec.layer_norm.state_dict().items()})
    return out


def load_own_state(draft, state: dict) -> None:
    """Load :func:`own_state`'s tensors into ``draft`` (exact keys; cast to the draft's dtype and device)."""
    dec = draft.model.decoder
    layers = {k[len("layers."):]: v for k, v in state.items() if k.startswith("layers.")}
    norm = {k[len("layer_norm."):]: v for k, v in state.items() if k.startswith("layer_norm.")}
    if len(layers) + len(norm) != len(state):
        raise ValueError(f"unexpected draft weights: {sorted(set(state) - {f'layers.{k}' for k in layers})[:5]}")
    dec.layers.load_state_dict(layers, strict=True)
    dec.layer_norm.load_state_dict(norm, strict=True)
    forget_fused(dec.layers)
