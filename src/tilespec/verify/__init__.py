"""The verification layer: ``verify()`` and the methods behind it (reference, hf, tiled, fused, sigmoid).

``tilespec.verify`` is this package *and* callable as :func:`tilespec.verify.api.verify`: ``tilespec.verify(...)``
verifies, while ``import tilespec.verify.registry`` (or ``.kernels.launch``, ...) reaches the modules. (Binding the
function over the package name made those imports fail.)

The names below, and the submodules, are imported on first use (PEP 562): the server's API processes import only
torch-free modules of this package (logit_settings, sampling_rules), and importing the package must not pull in
torch for them.
"""
import importlib
import inspect
import sys
from types import ModuleType

_WHERE = {"verify": "api", "SamplingParams": "types", "VerifyResult": "types", "VerifyInputs": "types",
          "Method": "registry", "available_methods": "registry", "get_method": "registry",
          "register_method": "registry"}

__all__ = ["verify", "SamplingParams", "VerifyResult", "VerifyInputs", "Method", "available_methods", "get_method",
           "register_method"]


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is not None:
        value = getattr(importlib.import_module(f"{__name__}.{where}"), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):       # a submodule the eager package used to import as a side effect
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))


class _CallablePackage(ModuleType):
    def __call__(self, *args, **kwargs):
        from .api import verify
        return verify(*args, **kwargs)

    @property
    def __signature__(self):
        from .api import verify
        return inspect.signature(verify)


sys.modules[__name__].__class__ = _CallablePackage
