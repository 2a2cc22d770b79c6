"""Saving and loading draft heads: ``$TILESPEC_HOME/heads/<target>/`` holds ``head.safetensors`` (the trainable
weights and the draft vocabulary) and ``manifest.json`` (the head config, the target's identity hash, the data it was
trained on, steps, held-out acceptance). A head belongs to one target: loading it for a model whose identity hash
differs is an error (a head reads that model's hidden states; on another model its drafts are noise).

The identity hash covers the target's architecture config (layers, sizes, vocabulary) and a sample of its weights
(embedding and LM head rows, the first layer's q projection), so a fine-tuned or re-quantised model does not match.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Optional

import torch

from tilespec.env import tilespec_home

from .model import DraftHead, HeadConfig

WEIGHTS = "head.safetensors"
MANIFEST = "manifest.json"
_CONFIG_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "rms_norm_eps", "rope_theta")


class HeadNotFound(FileNotFoundError):
    """No trained head for a target; the message says how to train one."""


class HeadMismatch(ValueError):
    """A head trained for another target."""


def target_identity(target, coarse: bool = False) -> str:
    """Short hash of the target's config and a sample of its weights (see the module docstring). ``coarse``: the
    weights rounded to bf16 first, so the same model loaded in fp32, fp16 or bf16 has one identity (a draft trained
    in fp32 and used in half precision)."""
    cfg = target.config
    h = hashlib.sha256(json.dumps({k: getattr(cfg, k, None) for k in _CONFIG_KEYS}, sort_keys=True,
                                  default=str).encode())
    inner = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    samples = [inner.embed_tokens.weight[:8], target.get_output_embeddings().weight[-8:],
               inner.layers[0].self_attn.q_proj.weight[:4]]
    for w in samples:
        w = w.detach().to(torch.bfloat16) if coarse else w.detach()
        h.update(w.float().cpu().contiguous().numpy().round(4).tobytes())
    return h.hexdigest()[:16]


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)).strip("_") or "target"


def head_dir(target_name: str) -> Path:
    """The default folder of ``target_name``'s head."""
    return tilespec_home() / "heads" / safe_name(target_name)


def save_head(head: DraftHead, folder, *, target_id: str, target_name: str, info: Optional[dict] = None) -> Path:
    """Write the head's weights (fp32... as stored: bf16 on GPU) and manifest into ``folder``; returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    tmp = folder / (WEIGHTS + ".tmp")
    save_file(state, str(tmp))
    tmp.replace(folder / WEIGHTS)
    manifest = {"format": "tilespec-draft-head/1", "target": target_name, "target_id": target_id,
                "config": head.cfg.to_dict(), **(info or {})}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return folder


def read_manifest(folder) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise HeadNotFound(f"no draft head at {folder} (missing {MANIFEST})")
    return json.loads(path.read_text())


def load_head(folder, target=None, *, target_name: Optional[str] = None, device=None, dtype=None) -> DraftHead:
    """The head saved in ``folder``; with ``target``: checked against its identity and bound to it (embedding, LM
    head rows, RoPE), on the target's device and dtype unless given."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        hint = f" --target {target_name}" if target_name else " --target NAME"
        raise HeadNotFound(f"no trained draft head at {folder}. Train one with `tilespec draft train{hint}` "
                           f"(or tilespec.training.train_head(...)), or pass --draft PATH to a head folder")
    manifest = read_manifest(folder)
    if target is not None:
        found = target_identity(target)
        if manifest.get("target_id") != found:
            raise HeadMismatch(f"the head at {folder} was trained for target {manifest.get('target')!r} "
                               f"(identity {manifest.get('target_id')}), not for this model (identity {found}); "
                               f"train a head for it with `tilespec draft train --target NAME`")
    from safetensors.torch import load_file

    state = load_file(str(folder / WEIGHTS))
    cfg = HeadConfig.from_dict(manifest["config"])
    head = DraftHead(cfg, vocab_ids=state["vocab_ids"])
    head.load_state_dict(state)
    head.manifest = manifest
    if target is not None:
        p = next(target.parameters())
        head.to(device=device or p.device, dtype=dtype or p.dtype)
        head.vocab_ids = head.vocab_ids.to(torch.int64)
        head.bind(target)
    head.eval()
    head.requires_grad_(False)
    return head
