"""One tree-verification step: score a token tree in ONE target forward, select the accepted path, keep its K/V.

Layout (B requests, C cache slots, write pointer W; see state.py): the tree's N nodes (node 0 = the pending token)
are written at slots W .. W + N - 1 with positions ``seq_len - 1 + depth``; node n attends to the request's valid
slots and to the slots of its own ancestors (itself included) -- :func:`tree_mask`. After selection
(:func:`tilespec.multidraft.tree.select_tree`) the accepted path's K/V are moved to slots W .. W + accepted with ONE
gather per buffer (:func:`compact`; path node j >= j, so reading all sources before writing is enough), after which
the state commits exactly like a chain step (the accepted slots become valid, the rest are holes past the new W).
A draft head is then fed the target's features along the accepted path (``observe``), as after a chain step.

Every function here is free of host syncs and keeps static shapes for a given (B, N, C, tree depth), so a whole
step (head tree, target forward, selection of a distinct tree, compaction, observe) can be captured in one CUDA
graph per shape bucket (engine/tree_decoder.py). ``write`` is a 0-d int64 device tensor throughout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tilespec.multidraft.tree import TokenTree, ancestors, select_tree, uniform_tables
from tilespec.verify import rng
from tilespec.verify.types import SamplingParams

from .drafters.base import StepView
from .graphs import GraphCache


@dataclass
class TreeStepOutput:
    """num_emitted [B]; output_tokens [B, D+1] (-1 padded); path_tokens [B, D] the accepted draft tokens in order
    (the ``draft_tokens`` a commit reads ``prev`` from); hidden [B, d] a head's new state or None;
    tree_sizes [B] nodes scored per request."""

    num_emitted: torch.Tensor
    output_tokens: torch.Tensor
    path_tokens: torch.Tensor
    hidden: Optional[torch.Tensor]
    tree_sizes: torch.Tensor


def window_gather(table: torch.Tensor, write: torch.Tensor, capacity: int) -> torch.Tensor:
    """table [B, Q, S] bool over the S slots from W on -> [B, Q, C] bool over the whole cache (False outside)."""
    b, q, s = table.shape
    rel = torch.arange(capacity, device=table.device) - write
    inside = (rel >= 0) & (rel < s)
    out = table.gather(2, rel.clamp(0, s - 1)[None, None, :].expand(b, q, capacity))
    return out & inside[None, None, :]


def tree_mask(valid: torch.Tensor, write: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
    """Bool mask [B, 1, N, C]: node n sees the valid slots and the slots W + m of its ancestors m (anc [B, N, N],
    :func:`~tilespec.multidraft.tree.ancestors`; a padding node sees only itself and its context)."""
    return (valid[:, None, :] | window_gather(anc, write, valid.shape[1])).unsqueeze(1)


def tree_positions(seq_len: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
    """[B, N] int64 positions: the pending token's (seq_len - 1) plus the node's depth."""
    return (seq_len - 1)[:, None] + anc.sum(dim=-1) - 1


def path_slots(path: torch.Tensor) -> torch.Tensor:
    """path [B, P] (node indices, -1 padded) -> source offsets [B, P]: path[j] where set, else j (left in place)."""
    own = torch.arange(path.shape[1], device=path.device)[None, :].expand_as(path)
    return torch.where(path >= 0, path, own)


def compact(buffers, write: torch.Tensor, path: torch.Tensor) -> None:
    """Move the accepted nodes' K/V to slots W .. W + P - 1, in place: buffers [B, H, C, D] (each layer's K and V),
    path [B, P] node indices (-1 padded). One gather and one copy per buffer."""
    src = path_slots(path)
    p = path.shape[1]
    dst = write + torch.arange(p, device=path.device)
    for buf in buffers:
        b, h, _, d = buf.shape
        idx = (write + src)[:, None, :, None].expand(b, h, p, d)
        buf.index_copy_(2, dst, buf.gather(2, idx))


def compact_runner(runner, write: torch.Tensor, path: torch.Tensor) -> None:
    """:func:`compact` on a runner: its slot buffers directly (native and head runners), else (transformers'
    ModelRunner) through its ``select`` with a slot permutation that differs from the identity only in the window."""
    if hasattr(runner, "caches") or hasattr(runner, "k"):
        compact(runner_buffers(runner), write, path)
        return
    b, p = path.shape
    cap = runner.capacity
    idx = torch.arange(cap, device=path.device)
    rel = idx - write
    inside = (rel >= 0) & (rel < p)
    src = write + path_slots(path).gather(1, rel.clamp(0, p - 1)[None, :].expand(b, cap))
    runner.select(torch.arange(b, device=path.device), torch.where(inside[None, :], src, idx[None, :]))


def runner_buffers(runner) -> list:
    """The slot K/V buffers of a native runner or a head runner (what :func:`compact` moves)."""
    if hasattr(runner, "caches"):
        if runner.caches is None:
            return []
        return [t for entry in runner.caches for t in entry[:2]]
    if hasattr(runner, "k") and hasattr(runner, "v"):
        return [runner.k, runner.v]
    raise TypeError(f"{type(runner).__name__} has no slot K/V buffers a tree step can compact; tree verification "
                    "needs the native runtime (compile='native' or 'native-graphs')")


def score_tree(target, tree: TokenTree, valid, seq_len, write: torch.Tensor, capture: tuple = (),
               write_slot: Optional[int] = None):
    """The target's ONE forward over every tree node -> logits [B, N, V] (with ``capture``: (logits, features)).
    ``write_slot`` (W as a host int): through the runner's own ``forward`` (its per-shape CUDA graph on
    "native-graphs"); None: ``raw_forward`` with the device W (inside a larger captured step, or eagerly)."""
    anc = ancestors(tree.parents)
    mask = tree_mask(valid, write, anc)
    positions = tree_positions(seq_len, anc)
    tokens = tree.tokens.clamp(min=0)
    if write_slot is not None:
        return target.forward(tokens, positions, mask, write_slot, capture=capture)
    return target.raw_forward(tokens, positions, mask, write, capture=capture)


_TABLES = GraphCache(lambda seeds, offsets, key=None: uniform_tables(seeds, offsets, *key))
_UNCAPTURED: set = set()      # helpers whose capture failed once: eager from then on


def graphed_uniforms(seeds: torch.Tensor, offsets: torch.Tensor, depth: int, width: int) -> tuple:
    """:func:`~tilespec.multidraft.tree.uniform_tables` replayed from a CUDA graph per shape on CUDA (Philox in
    PyTorch ops is ~180 small kernels per call); eager elsewhere, or where a capture fails."""
    if seeds.is_cuda and "tables" not in _UNCAPTURED:
        try:
            acc, smp = _TABLES(seeds, offsets, key=(depth, width))
            return acc.clone(), smp.clone()
        except Exception:   # noqa: BLE001 - a capture that fails: the same numbers eagerly
            _UNCAPTURED.add("tables")
            torch.cuda.synchronize(seeds.device)
    return uniform_tables(seeds, offsets, depth, width)


def _gumbel_argmax(logq: torch.Tensor, vocab: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                   key=None) -> torch.Tensor:
    noise = rng.gumbel(seeds[:, :, None], positions[:, None, None], rng.PURPOSE_EXTRA, vocab[None, None, :])
    return vocab[torch.argmax(logq + noise, dim=-1)]


_SAMPLES = GraphCache(_gumbel_argmax)


def sample_chains(logq: torch.Tensor, vocab: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor):
    """One token per (request, chain): logq [B, K, V'] log-law over the ids ``vocab`` [V'], Gumbel noise keyed by
    (chain seed [B, K], position [B], PURPOSE_EXTRA, token id) -> ids [B, K]; replayed from a CUDA graph per shape
    on CUDA (eager elsewhere or where a capture fails)."""
    if logq.is_cuda and "samples" not in _UNCAPTURED:
        try:
            return _SAMPLES(logq, vocab, seeds, positions).clone()
        except Exception:   # noqa: BLE001 - a capture that fails: the same draw eagerly
            _UNCAPTURED.add("samples")
            torch.cuda.synchronize(logq.device)
    return _gumbel_argmax(logq, vocab, seeds, positions)


def finish_step(target, head, tree: TokenTree, logits, feats, valid, seq_len, seeds, write, sampling: SamplingParams,
                scheme: str, sampler: str, max_depth: Optional[int] = None) -> TreeStepOutput:
    """Selection, compaction of the target's K/V (the head's path entries are rewritten by its observe), and the
    head's observe. ``max_depth``: the trees' depth when static (no host sync in the selection)."""
    sel = select_tree(tree, logits.float(), sampling=sampling, scheme=scheme, seed=seeds, offsets=seq_len,
                      sampler=sampler, check_values=False, max_depth=max_depth, uniforms=graphed_uniforms)
    compact_runner(target, write, sel.path)
    src = path_slots(sel.path)
    path_tokens = tree.tokens.gather(1, src)[:, 1:]
    path_tokens = torch.where(sel.path[:, 1:] >= 0, path_tokens, torch.full_like(path_tokens, -1))
    hidden = None
    if head is not None:      # the head's entries for the accepted path, as after a chain of its tokens
        feats_path = feats.gather(1, src[:, :, None].expand(-1, -1, feats.shape[-1]))
        root = tree.tokens[:, 0]
        view = StepView(valid=valid, seq_len=seq_len, pending=root, prev=root, seeds=seeds, write=write)
        hidden = head.observe(view, feats_path, sel.output_tokens, sel.num_emitted, None)
    return TreeStepOutput(num_emitted=sel.num_emitted, output_tokens=sel.output_tokens, path_tokens=path_tokens,
                          hidden=hidden, tree_sizes=tree.sizes)
