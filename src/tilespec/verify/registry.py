"""The registry of verification methods: each method is one module that registers a function under a name.

A method is ``fn(inputs: VerifyInputs) -> VerifyResult``. It must honour the whole contract (ragged K_b, seeds,
SamplingParams) or raise NotImplementedError naming what it does not support; ``exact`` says whether its output
law equals the target's (the exactness suite holds every exact method to that).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from .types import VerifyInputs, VerifyResult

MethodFn = Callable[[VerifyInputs], VerifyResult]


@dataclass(frozen=True)
class Method:
    name: str
    fn: MethodFn
    exact: bool
    description: str


_METHODS: dict[str, Method] = {}
# Modules that register methods when imported; importing lazily keeps `import tilespec` free of Triton.
_PROVIDERS = {
    "reference": "tilespec.verify.methods.reference",
    "hf": "tilespec.verify.methods.hf",
    "tiled": "tilespec.verify.methods.tiled",
    "sigmoid": "tilespec.verify.methods.sigmoid",
    "fused": "tilespec.verify.methods.fused",
}


def register_method(name: str, *, exact: bool, description: str) -> Callable[[MethodFn], MethodFn]:
    """Decorator: ``@register_method("reference", exact=True, description=...)``."""
    def wrap(fn: MethodFn) -> MethodFn:
        _METHODS[name] = Method(name=name, fn=fn, exact=exact, description=description)
        return fn
    return wrap


def get_method(name: str) -> Method:
    if name not in _METHODS and name in _PROVIDERS:
        try:
            importlib.import_module(_PROVIDERS[name])
        except ModuleNotFoundError as err:
            if err.name and err.name.startswith("tilespec"):
                raise ValueError(f"verification method {name!r} is not implemented in this version") from err
            raise ImportError(f"method {name!r} needs {err.name!r}; install it (e.g. pip install "
                              f"'tilespec[gpu]' for Triton)") from err
    if name not in _METHODS:
        raise ValueError(f"unknown verification method {name!r}; available: {', '.join(available_methods())}")
    return _METHODS[name]


def available_methods() -> list[str]:
    """Names of methods that can be requested (registered or provided by a known module)."""
    return sorted(set(_METHODS) | set(_PROVIDERS))
