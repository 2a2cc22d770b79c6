"""tilespec: exact, fast speculative decoding for PyTorch and Hugging Face models."""
from .verify import SamplingParams, VerifyResult, available_methods, verify

__version__ = "0.1.0"
__all__ = ["verify", "SamplingParams", "VerifyResult", "available_methods", "__version__"]
