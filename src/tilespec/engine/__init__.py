"""The speculative decoding engine: :class:`SpeculativeDecoder` over Hugging Face models (see docs/engine.md).

The names below are imported on first use (PEP 562): the decoder pulls in transformers, and processes that need only
a submodule -- the server's API processes (``engine.batch_request``), ``tilespec serve``'s main process before it
starts the engine process -- should not wait for it.
"""
from __future__ import annotations

import importlib

_WHERE = {"SpeculativeDecoder": "decoder", "GenerationOutput": "decoder", "StepEvent": "decoder",
          "ContextDrafter": "drafters", "Drafter": "drafters", "ModelDrafter": "drafters", "NgramDrafter": "drafters",
          "SuffixDrafter": "drafters", "GammaSchedule": "gamma", "OnlineGammaEstimator": "gamma",
          "expected_speedup": "gamma", "expected_tokens": "gamma", "optimal_gamma": "gamma", "RunStats": "metrics"}

__all__ = ["SpeculativeDecoder", "GenerationOutput", "StepEvent", "GammaSchedule", "OnlineGammaEstimator", "RunStats",
           "expected_speedup", "expected_tokens", "optimal_gamma", "Drafter", "ModelDrafter", "ContextDrafter",
           "NgramDrafter", "SuffixDrafter"]


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
