"""tilespec: exact, fast speculative decoding for PyTorch and Hugging Face models."""
import os as _os

import torch as _torch

if not _torch.cuda.is_available():
    # Without CUDA the Triton kernels can only run in Triton's interpreter, and Triton reads this variable when it
    # is first imported (transformers may import it early), so it is set as soon as tilespec is imported.
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from .verify import SamplingParams, VerifyResult, available_methods, verify  # noqa: E402

__version__ = "0.1.0"
__all__ = ["verify", "SamplingParams", "VerifyResult", "available_methods", "__version__"]
