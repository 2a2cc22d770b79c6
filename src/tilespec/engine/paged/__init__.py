"""The paged engine: paged K/V with prefix caching (blocks.py), a token-budget scheduler that batches chunked
prefill with decode (scheduler.py), the target's flattened forward over block tables (model.py, attention.py), and
the loop that drafts, verifies and commits (engine.py)."""
from .engine import PagedEngine

__all__ = ["PagedEngine"]
