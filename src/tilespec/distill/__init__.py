"""Drafts trained by the library from a target's own outputs (:mod:`.whisper`: a Distil-Whisper-style draft)."""
