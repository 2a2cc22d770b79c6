"""``tilespec serve``'s load of models by name (its EngineSpec.load), built from plain values: the main process spawns
the engine process without importing torch first (seconds with the CUDA libraries, which the engine process spends
on its own imports meanwhile), and the engine process resolves the device and the dtype. No torch at import."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LoadByName:
    """``target`` and ``draft`` (None: none) by name on ``device`` / ``dtype`` (the command line's strings, "auto"
    included): called in the engine process, it returns (target, draft, tokenizer) as tilespec.api.load_pair does."""

    target: str
    draft: Optional[str] = None
    device: str = "auto"
    dtype: str = "auto"

    def __call__(self) -> tuple:
        from tilespec.api import load_pair
        from tilespec.env import pick_device, pick_dtype
        device = pick_device(self.device)
        return load_pair(self.target, self.draft, device, pick_dtype(self.dtype, device), log=print)


def device_type(name: str) -> Optional[str]:
    """The type of a device name as torch.device parses it ("cuda:1" -> "cuda"); None for "auto" (the engine
    process decides: torch is needed to know whether CUDA is there)."""
    return None if name == "auto" else name.split(":", 1)[0]
