"""The token-tree options ``--tree auto | N``, ``--tree-branch B``, ``--tree-depth D`` of ``tilespec generate`` and
``tilespec bench e2e`` (docs/trees.md): parsing, the ``tree=`` value they give ``SpeculativeDecoder``, and the
shape a decoder ended up with (an ``auto`` one is chosen when its drafter is made).

``--tree auto``: the shape (branch, depth, nodes) is chosen by ``drafters/tree_choice.py`` from the draft head's
measured per-depth acceptance at the request temperature (its manifest's ``alpha_by_temperature``); a head without
it, or a context drafter, gets the default ``tree_choice.DEFAULT_TREE`` (8, 6, 32), as ``tree_drafter`` does.
``--tree N``: an explicit tree of N nodes (2 <= N <= 64, the root included) with ``--tree-branch`` (default 8) and
``--tree-depth`` (default 6), exactly as before ``auto`` existed.
"""
from __future__ import annotations

import argparse
from typing import Optional

from tilespec.engine.drafters.trees import MAX_NODES

AUTO = "auto"
DEFAULT_BRANCH, DEFAULT_DEPTH = 8, 6     # an explicit --tree N without --tree-branch / --tree-depth


def tree_nodes(text: str):
    """argparse ``type`` of ``--tree``: ``"auto"`` or an int node count in [2, MAX_NODES]."""
    value = str(text).strip()
    if value.lower() == AUTO:
        return AUTO
    try:
        nodes = int(value)
    except ValueError:
        nodes = None
    if nodes is None or not 2 <= nodes <= MAX_NODES:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a node count in [2, {MAX_NODES}] (root included), "
                                         f"got {text!r}")
    return nodes


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def add_tree_arguments(p, what: str) -> None:
    """Add ``--tree``, ``--tree-branch`` and ``--tree-depth`` to parser ``p``; ``what``: who verifies the tree
    (the first words of the help, e.g. "verify" or "our speculative systems verify")."""
    p.add_argument("--tree", type=tree_nodes, default=None, metavar="auto|N",
                   help=f"{what} a token tree per step, exact at every temperature (docs/trees.md): the draft "
                        f"head's EAGLE-2-style dynamic tree (--draft head or a head folder) or several n-gram "
                        f"matches of the context as branches (--draft ngram). N: a tree of N nodes (2..{MAX_NODES}, "
                        f"root included) shaped by --tree-branch / --tree-depth; auto: the (branch, depth, nodes) "
                        f"that maximise expected tokens per unit of step cost given the head's measured per-depth "
                        f"acceptance at the request temperature (its manifest's alpha_by_temperature, written by "
                        f"`tilespec draft train`); without it (an older head, ngram) the default "
                        f"({DEFAULT_BRANCH}, {DEFAULT_DEPTH}, 32)")
    p.add_argument("--tree-branch", type=_positive, default=None,
                   help=f"--tree N: children per expanded node (ngram: matches; default {DEFAULT_BRANCH})")
    p.add_argument("--tree-depth", type=_positive, default=None,
                   help=f"--tree N: levels of the tree (ngram: tokens per match; the γ of its steps; default "
                        f"{DEFAULT_DEPTH})")


def tree_option(args) -> Optional[object]:
    """The ``tree=`` of ``SpeculativeDecoder`` from parsed options: None (no --tree), ``"auto"`` or (branch,
    depth, nodes). ValueError when --tree-branch / --tree-depth come without --tree or with --tree auto."""
    tree = getattr(args, "tree", None)
    branch, depth = getattr(args, "tree_branch", None), getattr(args, "tree_depth", None)
    given = [name for name, v in (("--tree-branch", branch), ("--tree-depth", depth)) if v is not None]
    if tree is None:
        if given:
            raise ValueError(f"{' and '.join(given)} shape an explicit tree: add --tree N")
        return None
    if tree == AUTO:
        if given:
            raise ValueError(f"--tree auto chooses the branch and depth from the head's measured acceptance: drop "
                             f"{' and '.join(given)}, or give an explicit --tree N")
        return AUTO
    return (branch or DEFAULT_BRANCH, depth or DEFAULT_DEPTH, int(tree))


def chosen_tree(decoder) -> Optional[dict]:
    """The dynamic tree a decoder drafts: {"branch", "depth", "nodes", "auto", "source"} (source: "given",
    "alpha_by_temperature" for an auto shape chosen from the head's stored acceptance, "default" for the
    auto fallback), None when it drafts no tree (chains, or a chain decoder)."""
    shape = getattr(getattr(decoder, "drafter", None), "shape", None)
    if shape is None or getattr(shape, "tree", None) is None:
        return None
    branch, depth, nodes = (int(x) for x in shape.tree)
    source = "given"
    if shape.auto:      # tree_drafter read the base drafter's head manifest (drafters/trees.py)
        manifest = getattr(getattr(getattr(decoder.drafter, "base", None), "head", None), "manifest", None)
        source = "alpha_by_temperature" if (manifest or {}).get("alpha_by_temperature") else "default"
    return {"branch": branch, "depth": depth, "nodes": nodes, "auto": bool(shape.auto), "source": source}


def describe(tree: dict, temperature: float) -> str:
    """One line for the log: the tree a decoder drafts and where an auto shape came from."""
    text = f"tree: branch {tree['branch']}, depth {tree['depth']}, {tree['nodes']} nodes"
    if tree["source"] == "alpha_by_temperature":
        return text + f" (auto: chosen from the head's measured acceptance at T={temperature:g})"
    if tree["source"] == "default":
        return text + " (auto: the drafter stores no per-depth acceptance, so the default shape)"
    return text
