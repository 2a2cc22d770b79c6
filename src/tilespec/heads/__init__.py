"""Trained draft heads (EAGLE-style): the head module (model.py) and its storage (store.py). Training lives above the
engine, in tilespec.training (``train_head``). The engine drafts with a head through ``draft="head"``
(tilespec.engine.drafters.head); ``tilespec draft train --target NAME`` trains one. For a Whisper target it trains a
distilled decoder draft instead, a model stored by distilled.py and used as ``draft="distilled"``."""
from __future__ import annotations

from .distilled import DISTILLED_NAME, draft_dir, is_distilled_name, load_distilled, save_distilled
from .model import DraftHead, HeadConfig, config_for
from .store import HeadMismatch, HeadNotFound, head_dir, load_head, save_head, target_identity

__all__ = ["DraftHead", "HeadConfig", "config_for", "HeadMismatch", "HeadNotFound", "head_dir", "load_head",
           "save_head", "target_identity",
           "DISTILLED_NAME", "draft_dir", "is_distilled_name", "load_distilled", "save_distilled"]

