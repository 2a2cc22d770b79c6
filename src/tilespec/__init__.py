"""tilespec: exact, fast speculative decoding for PyTorch and Hugging Face models.

``tilespec.generate`` / ``tilespec.transcribe`` / ``tilespec.load`` (see :mod:`tilespec.api`) for models,
``tilespec.verify`` with :class:`SamplingParams` for the accept/resample step alone.
"""
from .env import use_triton_interpreter_without_cuda as _interpreter

_interpreter()   # before anything imports triton (see tilespec.env)

from .api import generate, load, transcribe  # noqa: E402
from . import verify  # noqa: E402  (the package, callable as the verify() function: tilespec/verify/__init__.py)
from .verify import SamplingParams, VerifyResult, available_methods  # noqa: E402

__version__ = "0.1.0"
__all__ = ["generate", "transcribe", "load", "verify", "SamplingParams", "VerifyResult", "available_methods",
           "__version__"]
