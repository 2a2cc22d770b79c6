"""One tree-verification step: score a token tree in ONE target forward, select the accepted path, keep its K/V.

Layout (B requests, C cache slots, write pointer W; see state.py): the tree's N nodes (node 0 = the pending token)
are written at slots W .. W + N - 1 with positions ``seq_len - 1 + depth``; node n attends to the request's valid
slots and to the slots of its own ancestors (itself included) -- :func:`tree_mask`. After selection
(:func:`tilespec.multidraft.tree.select_tree`) the accepted path's K/V are moved to slots W .. W + accepted with ONE
gather per buffer, or with one launch for all buffers (:func:`compact`, on CUDA; path node j >= j, so reading
all sources before writing is enough, and so is copying j = 0, 1, ... in order), after which
the state commits exactly like a chain step (the accepted slots become valid, the rest are holes past the new W).
A draft head is then fed the target's features along the accepted path (``observe``), as after a chain step.

The step body (engine/step.py ``verify_phase``) calls :func:`tree_forward` and :func:`tree_select` when the
proposal is a tree. Both are free of host syncs and keep static shapes for a given (B, N, C, tree depth) (the
selection of i.i.d. trees too when the proposal gives their ``width`` and the scheme is sync-free: sd, specinfer,
spectr; ``is`` solves LPs on the host), so a whole dynamic-tree or sampled-chains step is captured
like a chain step (engine/step_graph.py, the tree's shape in the graph keys). ``write`` is W: a host int, or a 0-d
int64 device tensor inside a captured step. There the pure-tensor parts -- :func:`tree_inputs` (ancestors, mask,
positions) and :func:`tree_path` (the selection, the path's tokens and features, the compaction's slots) -- run as
inductor-compiled regions (engine/fused.py); only the target forward and the K/V moves stay outside them.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from tilespec.env import triton_available
from tilespec.multidraft.tree import TokenTree, ancestors, select_tree, uniform_tables
from tilespec.verify import rng
from tilespec.verify.types import ResolvedSampling, SamplingParams
from tilespec.verify.validation import resolve_sampling

from .fused import fused, wanted
from .graphs import GraphCache


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


def compact_slots(write: torch.Tensor, path: torch.Tensor) -> tuple:
    """path [B, P] node indices (-1 padded) -> (dst [P] slots W .. W + P - 1, src [B, P] the slots read for them)."""
    p = path.shape[1]
    return write + torch.arange(p, device=path.device), write + path_slots(path)


def move_slots(buffers, dst: torch.Tensor, src: torch.Tensor) -> None:
    """buffers [B, H, C, D] (each layer's K and V): slot dst[j] <- slot src[b, j], in place; one gather and one
    copy per buffer (every source is read before any write)."""
    p = dst.shape[0]
    for buf in buffers:
        b, h, _, d = buf.shape
        buf.index_copy_(2, dst, buf.gather(2, src[:, None, :, None].expand(b, h, p, d)))


def move_path(buffers, dst: torch.Tensor, src: torch.Tensor) -> None:
    """:func:`move_slots` for a tree path's slots (src[b, j] >= dst[j] = W + j): every buffer in one launch where
    :func:`one_launch` says so (engine/native/slot_moves.py), else one gather and one copy per buffer."""
    if one_launch(buffers):
        from .native.slot_moves import move_path_slots
        try:
            move_path_slots(buffers, dst, src)
            return
        except Exception as err:   # a kernel that fails to build must not end tree decoding: PyTorch ops from now on
            _ONE_LAUNCH_FAILED.append(f"{type(err).__name__}: {err}")
            warnings.warn(f"the one-launch K/V compaction failed ({_ONE_LAUNCH_FAILED[0]}); using a gather per buffer")
    move_slots(buffers, dst, src)


_ONE_LAUNCH_FAILED: list = []    # the first failure of the one-launch kernel, if any (it is not tried again)


def one_launch(buffers) -> bool:
    """Whether :func:`move_path` moves ``buffers`` with the one-launch kernel: CUDA buffers it supports, when the
    "compact" kernel part is on (the default; TILESPEC_NATIVE_KERNELS may leave it out) and it never failed."""
    if _ONE_LAUNCH_FAILED or not buffers or not buffers[0].is_cuda or not triton_available():
        return False
    from .native.runner import active_kernel_parts
    from .native.slot_moves import supported
    return "compact" in active_kernel_parts() and supported(buffers)


def compact(buffers, write: torch.Tensor, path: torch.Tensor) -> None:
    """Move the accepted nodes' K/V to slots W .. W + P - 1, in place: buffers [B, H, C, D] (each layer's K and V),
    path [B, P] node indices (-1 padded). One launch on CUDA, else one gather and one copy per buffer."""
    move_path(buffers, *compact_slots(write, path))


def compact_runner(runner, write: torch.Tensor, path: torch.Tensor, slots: Optional[tuple] = None) -> None:
    """:func:`compact` on a runner: its slot buffers directly (native and head runners; ``slots``: the
    :func:`compact_slots` of ``path`` when already computed), else (transformers' ModelRunner) through its ``select``
    with a slot permutation that differs from the identity only in the window."""
    if hasattr(runner, "caches") or hasattr(runner, "k"):
        move_path(runner_buffers(runner), *(slots if slots is not None else compact_slots(write, path)))
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


_TABLES = GraphCache(lambda seeds, offsets, key=None: uniform_tables(seeds, offsets, *key))
_UNCAPTURED: set = set()      # helpers whose capture failed once: eager from then on


def _replayable(t: torch.Tensor, name: str) -> bool:
    """Whether a helper may replay its own graph: on CUDA, outside an enclosing capture (a whole-step graph records
    the helper's kernels itself), unless its capture failed once."""
    return t.is_cuda and name not in _UNCAPTURED and not torch.cuda.is_current_stream_capturing()


def graphed_uniforms(seeds: torch.Tensor, offsets: torch.Tensor, depth: int, width: int) -> tuple:
    """:func:`~tilespec.multidraft.tree.uniform_tables` replayed from a CUDA graph per shape on CUDA (Philox in
    PyTorch ops is ~180 small kernels per call); eager elsewhere, inside an enclosing capture, or where a capture
    fails."""
    if _replayable(seeds, "tables"):
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


def chains_kernel(logq: torch.Tensor, vocab: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor):
    """:func:`_gumbel_argmax` as one launch of the keyed Gumbel-max kernel, a row per (request, chain)."""
    from tilespec.verify.kernels.gumbel import gumbel_argmax
    b, k, v = logq.shape
    ones = torch.ones(b * k, dtype=torch.float32, device=logq.device)
    return gumbel_argmax(logq.reshape(b * k, v).contiguous(), ones, seeds.reshape(-1), positions.repeat_interleave(k),
                         rng.PURPOSE_EXTRA, vocab).view(b, k)


def sample_chains(logq: torch.Tensor, vocab: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor):
    """One token per (request, chain): logq [B, K, V'] log-law over the ids ``vocab`` [V'], Gumbel noise keyed by
    (chain seed [B, K], position [B], PURPOSE_EXTRA, token id) -> ids [B, K]; replayed from a CUDA graph per shape
    on CUDA (eager elsewhere, inside an enclosing capture, or where a capture fails); on a GPU with Triton one
    launch of the keyed Gumbel-max kernel (verify/kernels/gumbel.py: the same noise, no graph needed)."""
    if logq.is_cuda and triton_available():
        return chains_kernel(logq, vocab, seeds, positions)
    if _replayable(logq, "samples"):
        try:
            return _SAMPLES(logq, vocab, seeds, positions).clone()
        except Exception:   # noqa: BLE001 - a capture that fails: the same draw eagerly
            _UNCAPTURED.add("samples")
            torch.cuda.synchronize(logq.device)
    return _gumbel_argmax(logq, vocab, seeds, positions)


def tree_inputs(parents: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, write,
                seq_len: torch.Tensor) -> tuple:
    """The target forward's inputs for a tree (parents / tokens [B, N], valid [B, C], W, seq_len [B]) -> (tokens
    [B, N] (padding: 0), positions [B, N], mask [B, 1, N, C])."""
    anc = ancestors(parents)
    return tokens.clamp(min=0), tree_positions(seq_len, anc), tree_mask(valid, write, anc)


def tree_forward(target, view, tree: TokenTree, ex, capture: tuple = ()):
    """The target's ONE forward over every tree node through the execution ``ex`` (engine/execution.py) ->
    logits [B, N, V] (with ``capture``: (logits, features [B, N, n d])); K/V written at slots W .. W + N - 1."""
    tokens, positions, mask = fused(tree_inputs, wanted(ex, tree.parents))(tree.parents, tree.tokens, view.valid,
                                                                            view.write, view.seq_len)
    return ex.forward(target, tokens, positions, mask, view.write, capture=capture)


def tree_path(tree: TokenTree, logits: torch.Tensor, feats: Optional[torch.Tensor], sampling: ResolvedSampling,
              seeds: torch.Tensor, offsets: torch.Tensor, write, depth_cap: Optional[torch.Tensor], scheme: str,
              sampler: str, depth: Optional[int], width: Optional[int], uniforms=graphed_uniforms) -> tuple:
    """``select_tree`` over ``tree`` (logits [B, N, V] in any float dtype) and what the step reads off its path:
    (num_emitted [B], output_tokens [B, D+1], path [B, D+1] node indices (-1 padded), path_tokens [B, D] the accepted
    drafts (-1 padded), the features along the path [B, D+1, n d] or None, the :func:`compact_slots` (dst [D+1],
    src [B, D+1])). No host sync when ``depth`` is given (and ``width`` for sync-free iid schemes)."""
    sel = select_tree(tree, logits.float(), sampling=sampling, scheme=scheme, seed=seeds, offsets=offsets,
                      sampler=sampler, check_values=False, max_depth=depth, uniforms=uniforms, depth_cap=depth_cap,
                      max_width=width)
    src = path_slots(sel.path)
    path_tokens = tree.tokens.gather(1, src)[:, 1:]
    path_tokens = torch.where(sel.path[:, 1:] >= 0, path_tokens, torch.full_like(path_tokens, -1))
    if feats is not None:
        feats = feats.gather(1, src[:, :, None].expand(-1, -1, feats.shape[-1]))
    return sel.num_emitted, sel.output_tokens, sel.path, path_tokens, feats, compact_slots(write, sel.path)


def tree_select(target, view, proposal, logits: torch.Tensor, feats: Optional[torch.Tensor],
                sampling: SamplingParams, ex=None) -> tuple:
    """Select the accepted path of ``proposal.tree`` and compact the target's K/V along it, so the step looks like a
    chain step over the path: (num_emitted [B], output_tokens [B, D+1] (-1 padded), path_tokens [B, D] the accepted
    draft tokens (-1 padded: the ``draft_tokens`` a commit reads ``prev`` from), the features along the path
    [B, D+1, n d] or None). A draft head's own path entries are rewritten by its ``observe``. ``ex``: the
    execution (a captured one on CUDA runs :func:`tree_path` compiled)."""
    tree = proposal.tree
    # resolved outside the region: a compiled region reads resolve_sampling's cached constants, never builds them
    resolved = resolve_sampling(sampling, logits.shape[0], logits.device)
    # top-k / top-p thresholds pick their kernel on the host (verify/filters.py), which dynamo does not trace
    on = ex is not None and wanted(ex, logits) and not (resolved.has_top_k or resolved.has_top_p)
    # graphed_uniforms replays its own graph only outside a capture, where no region is compiled
    num_emitted, out, path, path_tokens, feats, slots = fused(tree_path, on)(
        tree, logits, feats, resolved, view.seeds, view.seq_len, view.write, proposal.counts, proposal.scheme,
        proposal.sampler, proposal.depth, proposal.width, uniforms=uniform_tables if on else graphed_uniforms)
    compact_runner(target, view.write, path, slots)
    return num_emitted, out, path_tokens, feats
