"""Training drafts on a target's own outputs (above the engine, which generates the data):

* :func:`train_head` (head_training.py, data in head_data.py): an EAGLE-style draft head (tilespec.heads) by
  self-distillation on responses the target generates with the engine, its settings a :class:`HeadTrainConfig`;
  ``tilespec draft train`` runs it;
* :func:`train_whisper_draft` (whisper_training.py, the loss in whisper_draft.py): a Distil-Whisper-style decoder
  draft (the target's encoder shared, decoder layers copied from the target, KL to the target on its own
  transcripts); ``tilespec draft train --target <a Whisper model>`` runs it.
"""
from __future__ import annotations

from .head_training import HeadTrainConfig, train_head
from .whisper_training import train_whisper_draft

__all__ = ["HeadTrainConfig", "train_head", "train_whisper_draft"]
