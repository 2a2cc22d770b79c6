"""The verification layer: ``verify()`` and the methods behind it (reference, hf, tiled, fused, sigmoid)."""
from .api import verify
from .registry import Method, available_methods, get_method, register_method
from .types import SamplingParams, VerifyInputs, VerifyResult

__all__ = ["verify", "SamplingParams", "VerifyResult", "VerifyInputs", "Method", "available_methods", "get_method",
           "register_method"]
