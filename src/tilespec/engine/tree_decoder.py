"""``TreeDecoder``: :class:`~tilespec.engine.SpeculativeDecoder` verifying a token tree per step, with the tree
defaults (a head's dynamic tree shaped from its per-depth acceptance at the sampling temperature, else (8, 6, 32);
the native runtime).

There is one decode loop: trees run through the same step body as chains (engine/step.py ``verify_phase``: tree mask
and positions, exact selection by ``select_tree``, the accepted path's K/V compacted to the next slots) and, for
dynamic trees on native runners, the same whole-step graphs (step_graph.py). The drafter proposes the trees
(drafters/trees.py). ``TreeDecoder(target, draft, tree=..., ...)`` is ``SpeculativeDecoder(target, draft,
tree=..., compile="native-graphs" on CUDA / "native" elsewhere, ...)``; its outputs and stats are the decoder's
(``stats.block_efficiency`` = tokens per target forward).
"""
from __future__ import annotations

from typing import Optional, Sequence

from tilespec.verify.types import SamplingParams

from .decoder import SpeculativeDecoder

TREE_MODES = ("eager", "native", "native-graphs")


class TreeDecoder(SpeculativeDecoder):
    """Tree-verified speculative decoding of ``target`` (see the module docstring).

    Args:
        draft: "head" (the target's trained head), a head folder or a HeadDrafter; "ngram" (several matches of the
            context as branches, tree=(matches, length, nodes)); or a draft model (chains=(K, L)).
        tree: (branch, depth, nodes) of the dynamic tree, nodes <= 64 including the root, or "auto" (the default:
            drafters/tree_choice.py, from the head's ``alpha_by_temperature``; (8, 6, 32) without it); chains: (K, L) K sampled
            chains of L tokens instead (then ``scheme`` selects: specinfer, spectr, is, ...).
        sampling: the target's SamplingParams; draft_sampling: the chains' draft law (default: sampling).
        compile: False / "eager", "native" or "native-graphs" / True ("native" on CPU).
        Other arguments as for :class:`SpeculativeDecoder`.
    """

    def __init__(self, target, draft="head", *, tree: Optional[Sequence[int] | str] = "auto",
                 chains: Optional[Sequence[int]] = None, scheme: str = "specinfer",
                 sampling: SamplingParams = SamplingParams(), draft_sampling: Optional[SamplingParams] = None,
                 compile: bool | str = True, **options):
        if not hasattr(target, "config"):
            raise TypeError(f"target must be a Hugging Face model, got {type(target).__name__}")
        if compile is True:
            compile = "native-graphs" if next(target.parameters()).device.type == "cuda" else "native"
        compile = "eager" if compile is False else compile
        if compile not in TREE_MODES:
            raise ValueError(f"tree decoding runs eagerly or on the native runtime: compile must be one of "
                             f"{TREE_MODES}, True or False, got {compile!r}")
        super().__init__(target, draft, tree=None if chains is not None else tree, chains=chains, scheme=scheme,
                         sampling=sampling, draft_sampling=draft_sampling,
                         compile=False if compile == "eager" else compile, **options)
