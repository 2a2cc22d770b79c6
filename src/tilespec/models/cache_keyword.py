"""The keyword under which a transformers forward takes its KV cache, across transformers releases (a models-layer
fact about the loaded model's API; the engine and the multi-draft reference decoder both call forwards with it)."""
from __future__ import annotations

import inspect

_CACHE_KW: dict = {}


def cache_kwarg(model) -> str:
    """The keyword under which ``model``'s transformers forward takes its KV cache: ``cache`` (recent transformers,
    which deprecate ``past_key_values`` with a warning) or ``past_key_values`` (older 5.x releases)."""
    cls = type(model)
    name = _CACHE_KW.get(cls)
    if name is None:
        name = _CACHE_KW[cls] = "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
    return name


def output_cache(out):
    """The KV cache a transformers forward returned, under either name (see :func:`cache_kwarg`)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
