"""Native model forwards for the engine: compact decoders over a loaded transformers model's weights, written to be
compiled whole (one layer function shared by all layers) and replayed as CUDA graphs. See llama.py and runner.py."""
from .llama import SUPPORTED, NativeLlama, unsupported_reason
from .runner import NATIVE_MODES, NativeRunner, native_model

__all__ = ["SUPPORTED", "NativeLlama", "unsupported_reason", "NATIVE_MODES", "NativeRunner", "native_model"]
