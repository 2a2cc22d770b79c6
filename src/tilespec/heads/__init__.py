"""Trained draft heads (EAGLE-style): the head module (model.py), self-distillation training (train.py), its data
(data.py) and storage (store.py). The engine drafts with a head through ``draft="head"``
(tilespec.engine.drafters.head); ``tilespec draft train --target NAME`` trains one."""
from __future__ import annotations

from .model import DraftHead, HeadConfig, config_for
from .store import HeadMismatch, HeadNotFound, head_dir, load_head, save_head, target_identity

__all__ = ["DraftHead", "HeadConfig", "config_for", "HeadMismatch", "HeadNotFound", "head_dir", "load_head",
           "save_head", "target_identity", "train_head"]


def train_head(*args, **kwargs):
    """See :func:`tilespec.heads.train.train_head` (imported on use: it pulls in the engine)."""
    from .train import train_head as run
    return run(*args, **kwargs)
