"""The speculative decoding engine: :class:`SpeculativeDecoder` over Hugging Face models (see docs/engine.md)."""
from .decoder import GenerationOutput, SpeculativeDecoder, StepEvent
from .drafters import ContextDrafter, Drafter, ModelDrafter, NgramDrafter, SuffixDrafter
from .gamma import GammaSchedule, OnlineGammaEstimator, expected_speedup, expected_tokens, optimal_gamma
from .metrics import RunStats

__all__ = ["SpeculativeDecoder", "GenerationOutput", "StepEvent", "GammaSchedule", "OnlineGammaEstimator", "RunStats",
           "expected_speedup", "expected_tokens", "optimal_gamma", "Drafter", "ModelDrafter", "ContextDrafter",
           "NgramDrafter", "SuffixDrafter"]
