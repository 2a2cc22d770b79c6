"""Saving and loading distilled Whisper drafts (tilespec.models.distilled), with the conventions of the head store
(store.py): ``$TILESPEC_HOME/drafts/<target>/`` holds ``draft.safetensors`` (the draft's own weights: its decoder
layer copies and final norm, fp32 as trained) and ``manifest.json`` (format, target name and identity hash, the
decoder layers copied, the data, steps, held-out acceptance, suggested γ). A draft belongs to one target: loading it
for a model whose identity hash differs raises :class:`HeadMismatch`; a missing one :class:`HeadNotFound`, naming
the command that trains it. By name, ``--draft distilled`` is the default folder of the target's registry name.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from tilespec.env import tilespec_home

from .store import MANIFEST, HeadMismatch, HeadNotFound, safe_name, target_identity

DISTILLED_NAME = "distilled"
FORMAT = "tilespec-distilled-whisper/1"
WEIGHTS = "draft.safetensors"


def draft_dir(target_name: str) -> Path:
    """The default folder of ``target_name``'s distilled draft."""
    return tilespec_home() / "drafts" / safe_name(target_name)


def is_distilled_folder(path) -> bool:
    """True when ``path`` is a folder holding a distilled draft's manifest."""
    manifest = Path(str(path)).expanduser() / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text()).get("format") == FORMAT
    except (ValueError, OSError):
        return False


def is_distilled_name(name) -> bool:
    """``--draft`` values that name a distilled draft: ``distilled`` or a folder holding one."""
    return isinstance(name, (str, Path)) and (str(name) == DISTILLED_NAME or is_distilled_folder(name))


def save_distilled(draft, folder, *, target_id: str, target_name: str, info: Optional[dict] = None) -> Path:
    """Write the draft's own weights (fp32) and the manifest into ``folder``; returns the folder."""
    from safetensors.torch import save_file

    from tilespec.models.distilled import own_state

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().cpu() for k, v in own_state(draft).items()}
    tmp = folder / (WEIGHTS + ".tmp")
    save_file(state, str(tmp))
    tmp.replace(folder / WEIGHTS)
    manifest = {"format": FORMAT, "target": target_name, "target_id": target_id,
                "layers": list(draft.tilespec_distilled["layers"]), "total": draft.tilespec_distilled["total"],
                **(info or {})}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
    return folder


def find_folder(name, target_name: Optional[str]) -> Path:
    """The folder a ``--draft`` value names: ``distilled`` -> :func:`draft_dir` of the target's name, else the path."""
    if str(name) == DISTILLED_NAME:
        if not target_name:
            raise HeadNotFound("draft 'distilled' needs the target's registry name to find its folder; pass the "
                               "draft's folder instead")
        return draft_dir(target_name)
    return Path(str(name)).expanduser()


def load_distilled(folder, target, *, target_name: Optional[str] = None):
    """The distilled draft saved in ``folder``, built on ``target`` (encoder, embeddings, LM head shared) in the
    target's device and dtype, checked against its identity. Raises HeadNotFound / HeadMismatch."""
    import torch
    from safetensors.torch import load_file

    from tilespec.models.distilled import load_own_state, student, trainable

    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        hint = target_name or "NAME"
        raise HeadNotFound(f"no distilled draft at {folder}. Train one with `tilespec draft train --target {hint}` "
                           f"(or pass --draft PATH to a draft folder; without a draft, decoding is target-only)")
    manifest = json.loads((folder / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise HeadNotFound(f"{folder} holds a {manifest.get('format', 'draft head')!r}, not a distilled Whisper draft")
    found = target_identity(target, coarse=True)
    if manifest.get("target_id") != found:
        raise HeadMismatch(f"the distilled draft at {folder} was trained for target {manifest.get('target')!r} "
                           f"(identity {manifest.get('target_id')}), not for this model (identity {found}); "
                           f"train one for it with `tilespec draft train --target NAME`")
    draft = student(target, [int(i) for i in manifest["layers"]])
    load_own_state(draft, load_file(str(folder / WEIGHTS)))
    draft.eval()
    for p in trainable(draft):
        p.requires_grad_(False)
    draft.tilespec_manifest = manifest
    draft.tilespec_name = str(folder)
    with torch.no_grad():
        draft.to(device=next(target.parameters()).device, dtype=next(target.parameters()).dtype)
    return draft
