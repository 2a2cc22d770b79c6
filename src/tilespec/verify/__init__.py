"""The verification layer: ``verify()`` and the methods behind it (reference, hf, tiled, fused, sigmoid).

``tilespec.verify`` is this package *and* callable as :func:`tilespec.verify.api.verify`: ``tilespec.verify(...)``
verifies, while ``import tilespec.verify.registry`` (or ``.kernels.launch``, ...) reaches the modules. (Binding the
function over the package name made those imports fail.)
"""
import inspect
import sys
from types import ModuleType

from .api import verify
from .registry import Method, available_methods, get_method, register_method
from .types import SamplingParams, VerifyInputs, VerifyResult

__all__ = ["verify", "SamplingParams", "VerifyResult", "VerifyInputs", "Method", "available_methods", "get_method",
           "register_method"]


class _CallablePackage(ModuleType):
    def __call__(self, *args, **kwargs):
        return verify(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
__signature__ = inspect.signature(verify)
