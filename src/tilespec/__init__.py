"""tilespec: exact, fast speculative decoding for PyTorch and Hugging Face models.

``tilespec.generate`` / ``tilespec.transcribe`` / ``tilespec.load`` (see :mod:`tilespec.api`) for models,
``tilespec.verify`` with :class:`SamplingParams` for the accept/resample step alone.

The names are imported on first use (PEP 562): ``import tilespec`` (which every ``tilespec.*`` import runs) then
costs no torch import, so a process that needs only a light module -- ``tilespec serve``'s main process before it
starts the engine process -- gets there at once.
"""
import importlib

from .env import cache_bytecode_in_home as _bytecode
from .env import use_triton_interpreter_without_cuda as _interpreter

_interpreter()   # before anything imports triton (see tilespec.env)
_bytecode()      # before torch's modules are compiled from source in every process (see tilespec.env)

_WHERE = {"generate": ".api", "load": ".api", "transcribe": ".api", "verify": ".verify",
          "SamplingParams": ".verify", "VerifyResult": ".verify", "available_methods": ".verify"}

__version__ = "0.1.0"
__all__ = ["generate", "transcribe", "load", "verify", "SamplingParams", "VerifyResult", "available_methods",
           "__version__"]


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(where, __name__)
    value = module if name == "verify" else getattr(module, name)    # verify: the package, callable as verify()
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
