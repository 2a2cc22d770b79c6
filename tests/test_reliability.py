"""Reliability cases that run on the CPU (docs/reliability.md lists every case)."""
from __future__ import annotations

import pytest
import torch

from tilespec.engine import graphs


def test_workspace_clear_makes_graph_caches_capture_again(monkeypatch):
    """The mechanism behind the crash after transformers' static-compiled generate: any call of
    torch._C._cuda_clearCublasWorkspaces (CUDA-graph trees make one around every warm-up and recording) bumps the
    epoch, and a GraphCache with graphs from an older epoch drops them before its next call."""
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append(1), raising=False)
    cache = graphs.GraphCache(lambda x, key=None: x)
    cache._graphs["stale"] = object()                # stands for a graph captured before the clear
    epoch = graphs.workspace_epoch()
    torch._C._cuda_clearCublasWorkspaces()           # what torch._inductor.cudagraph_trees calls
    assert calls == [1] and graphs.workspace_epoch() == epoch + 1
    with pytest.raises(RuntimeError, match="CUDA"):   # CPU: the fresh capture itself is refused ...
        cache(torch.ones(2))
    assert len(cache) == 0                            # ... but the stale graph is gone first
    graphs._watch_workspace_clears()                 # idempotent: one wrapper, one count per clear
    torch._C._cuda_clearCublasWorkspaces()
    assert calls == [1, 1] and graphs.workspace_epoch() == epoch + 2
