"""Training drafts on a target's own outputs (above the engine, which generates the data):

* :func:`train_head` (head_training.py, data in head_data.py): an EAGLE-style draft head (tilespec.heads) by
  self-distillation on responses the target generates with the engine; ``tilespec draft train`` runs it;
* whisper_draft.py: a Distil-Whisper-style decoder draft (the target's encoder shared, decoder layers copied from
  the target, KL to the target on its own transcripts).
"""
from __future__ import annotations

from .head_training import train_head

__all__ = ["train_head"]
