"""Tensor parallelism for the native Llama-family decoder: one process per GPU, the target's weights sharded over
the ranks of a :class:`~torch.distributed.device_mesh.DeviceMesh` (NCCL on GPUs, gloo on CPU), everything else
replicated.

Layout (Megatron's): every rank holds H / tp query heads and H_kv / tp K/V heads of every layer and F / tp MLP
columns; the fused q/k/v rows are re-ordered so that rank r's shard is [q_r; k_r; v_r] (and gate/up's [gate_r; up_r]),
then placed with DTensor (``Shard(0)`` for q/k/v, gate/up and the LM head, ``Shard(1)`` for the output and down
projections). A layer then runs unchanged on its local shards with two sums over the ranks (after the output and the
down projections, ``decoder_layer``'s ``reduce``); the LM head is vocab-parallel and its [B, q, V / tp] logits are
gathered, so ``verify()`` sees the full [B, q, V] logits on every rank. Embedding, norms and RoPE are replicated.

Why local shards and explicit sums rather than DTensor modules end to end: the runtime slices the fused q/k/v output
per head group and reshapes it into heads, which on a ``Shard(-1)`` DTensor redistributes (gathers) the activations;
on local shards the same code runs with the two all-reduces a layer needs and nothing else. The sums are the
functional collectives DTensor itself issues for a ``Partial -> Replicate`` redistribution
(``torch.distributed._functional_collectives.all_reduce``), which dynamo traces into the compiled layer and a CUDA
graph captures. On CUDA the default (``allreduce="auto"``) is PyTorch's symmetric-memory one-shot all-reduce (P2P
over NVLink, multicast never used) for decode-sized inputs: 0.39 ms less per token than NCCL for a 14B shape at TP=2
(7.90 vs 8.29 ms, bench/results/tensor-parallel-h100x2.json); larger inputs (prefill) take NCCL.

Same tokens on every rank: the gathered logits are identical on every rank (all-gather and all-reduce results are
bitwise equal across ranks) and the sampling is keyed by (seed, position) through Philox, so every rank draws the
same tokens with no broadcast; drafts (draft models, context drafters) are replicated and run without collectives.
``check=True`` (or ``settings.configure(tp_check=True)``) verifies it: every target forward compares its input tokens and
positions across ranks on the device (graph-safe) and :func:`check_consistent` raises on the host.

Launch: ``torchrun --nproc-per-node N ...``; :func:`init_tensor_parallel` reads the launcher's environment
(tp_launch.py: the checks before any weight loads, ending every rank when one fails); the sums are in
tp_collectives.py ("nccl", "symm", "best").
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Shard, distribute_tensor

from tilespec import settings

from .llama import LayerWeights, NativeLlama
from .tp_collectives import (ALLREDUCE, BEST, SYMM_MAX_ELEMENTS, SYMM_VARIANT, best_all_reduce, nccl_all_reduce,
                             reducer, resolve_allreduce, symm_all_reduce)
from .tp_launch import (TensorParallel, check_divisible, check_gpus, check_launch, check_target, init_tensor_parallel,
                        run_rank)


# ------------------------------------------------------------------------------------------------ sharding
def _by_rank(w: torch.Tensor, sizes: list, tp: int) -> torch.Tensor:
    """Rows of ``w`` (blocks of ``sizes`` stacked on dim 0) re-ordered so that its r-th of tp equal row chunks holds
    the r-th chunk of every block: a ``Shard(0)`` placement then gives rank r [block_0 chunk r; block_1 chunk r;
    ...]."""
    blocks = [b.chunk(tp, 0) for b in torch.split(w, sizes, 0)]
    return torch.cat([blocks[j][r] for r in range(tp) for j in range(len(sizes))], 0)


class _Placer:
    """Turns full tensors into this rank's shard on its device (DTensor placement; no communication: every rank
    holds the full tensor). Tensors on the meta device (shape-only models, for benchmarks) become random shards:
    N(0, 0.02) weights (``std``), seeded by (``seed``, tensor index, rank), made on the device."""

    def __init__(self, tp: TensorParallel, seed: int = 0):
        self.tp, self.seed, self.count = tp, seed, 0

    def shard(self, w: torch.Tensor, dim: int, std: float = 0.02) -> torch.Tensor:
        self.count += 1
        if w.is_meta:
            shape = list(w.shape)
            shape[dim] //= self.tp.size
            return self._random(shape, w.dtype, std, self.tp.rank)
        local = distribute_tensor(w.detach(), self.tp.mesh, [Shard(dim)], src_data_rank=None).to_local()
        return local.to(self.tp.device).contiguous()

    def replicate(self, w: torch.Tensor, std: float = 0.02, ones: bool = False) -> torch.Tensor:
        self.count += 1
        if w.is_meta:
            if ones:
                return torch.ones(w.shape, dtype=w.dtype, device=self.tp.device)
            return self._random(list(w.shape), w.dtype, std, 0)
        return w.detach().to(self.tp.device)

    def _random(self, shape, dtype, std, rank) -> torch.Tensor:
        gen = torch.Generator(self.tp.device).manual_seed(self.seed * 1_000_003 + self.count * 1009 + rank)
        return (torch.randn(shape, generator=gen, device=self.tp.device, dtype=torch.float32) * std).to(dtype)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class TensorParallelLlama(NativeLlama):
    """:class:`NativeLlama` over this rank's shards (see the module docstring): ``heads`` / ``kv_heads`` are the
    local counts, ``lm_head`` the local vocabulary rows (padded to a multiple of tp); :meth:`forward` returns the
    gathered logits [B, q or keep, V]."""

    def __init__(self, model, tp: TensorParallel, *, allreduce: str = "auto", check: bool = False, seed: int = 0):
        check_divisible(model.config, tp.size)
        super().__init__(model)
        place = _Placer(tp, seed)
        n = tp.size
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        width = model.config.intermediate_size
        layers = []
        for w in self.layers:
            bias = None
            if w.qkv_bias is not None:
                bias = place.shard(_by_rank(w.qkv_bias[:, None], [q, kv, kv], n)[:, 0], 0)
            layers.append(LayerWeights(
                ln1=place.replicate(w.ln1, ones=True), qkv=place.shard(_by_rank(w.qkv, [q, kv, kv], n), 0),
                qkv_bias=bias, o=place.shard(w.o, 1), ln2=place.replicate(w.ln2, ones=True),
                gate_up=place.shard(_by_rank(w.gate_up, [width, width], n), 0), down=place.shard(w.down, 1)))
        self.layers = layers
        self.vocab = self.lm_head.shape[0]
        pad = -self.vocab % n
        head = self.lm_head
        if pad:
            head = torch.cat([head, head.new_zeros((pad, head.shape[1]))]) if not head.is_meta else \
                torch.empty((self.vocab + pad, head.shape[1]), dtype=head.dtype, device="meta")
        self.embed = place.replicate(self.embed)
        self.lm_head = place.shard(head, 0)
        self.norm = place.replicate(self.norm, ones=True)
        self.inv_freq = self.inv_freq.to(tp.device)
        self.heads, self.kv_heads = self.heads // n, self.kv_heads // n
        self.tp = tp
        self.allreduce = resolve_allreduce(allreduce, tp.device)
        self.reduce = reducer(self.allreduce, tp.group_name)
        self.check = check
        self.collectives = True
        self.mismatches = torch.zeros((), dtype=torch.int64, device=tp.device)
        self._place = place

    def placed(self, p: torch.Tensor) -> torch.Tensor:
        """A replicated parameter of the transformers model on this rank's device (random if on meta; 1-D: ones)."""
        return self._place.replicate(p, ones=p.dim() == 1)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, write_pos: torch.Tensor,
                caches: list, keep: Optional[int] = None, **kw) -> torch.Tensor:
        """As :meth:`NativeLlama.forward`, with the two sums per layer and the vocab-parallel head gathered:
        logits [B, q or keep, V] (model dtype), equal on every rank."""
        if self.check:
            self._compare_inputs(tokens, positions)
        local = super().forward(tokens, positions, mask, write_pos, caches, keep=keep, reduce=self.reduce, **kw)
        if not self.collectives:      # timing only: this rank's logits tiled to [B, q, V] (no communication)
            return torch.cat([local] * self.tp.size, -1)[..., :self.vocab]
        full = funcol.all_gather_tensor(local.contiguous(), local.dim() - 1, self.tp.group_name)
        if isinstance(full, funcol.AsyncCollectiveTensor):
            full = full.wait()
        return full[..., :self.vocab] if full.shape[-1] != self.vocab else full

    def drop_collectives(self) -> None:
        """For timing only (the share of a step spent in the sums): the sums become the identity and the logits
        this rank's own tiled to the vocabulary, so a step runs the same kernels minus every collective. The
        outputs are wrong and the ranks no longer agree; call before the first forward (compiled code keeps it)."""
        self.reduce = _identity
        self.collectives = False
        self.check = False

    def _compare_inputs(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Count (on the device, no sync) forwards whose tokens or positions differ between ranks; outside a graph
        capture the count is checked at once."""
        both = torch.cat([tokens.reshape(-1), positions.reshape(-1)])
        hi = funcol.all_reduce(both, "max", self.tp.group_name)
        lo = funcol.all_reduce(both, "min", self.tp.group_name)
        self.mismatches += (hi != lo).any().to(torch.int64)
        capturing = both.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and not both.is_cuda:
            self.raise_on_mismatch()

    def raise_on_mismatch(self) -> None:
        """RuntimeError when any checked forward saw different inputs on different ranks (host sync)."""
        n = int(self.mismatches.item())
        if n:
            raise RuntimeError(f"tensor-parallel ranks diverged: {n} target forwards got different tokens or "
                               f"positions on rank {self.tp.rank} than on another rank")


def shard(model, tp: TensorParallel, *, allreduce: str = "auto", check: Optional[bool] = None, seed: int = 0):
    """Shard a loaded (CPU, meta or GPU) transformers Llama-family model over ``tp`` in place and return it.

    Afterwards the engine runs it through :class:`TensorParallelLlama` on ``tp.device`` (``native`` or
    ``native-graphs`` mode): the sharded module weights are replaced by meta tensors of their full shapes (the
    transformers forward cannot run any more, and fails loudly if called), replicated parameters move to the device.
    ``check``: compare every forward's inputs across ranks (default: ``settings.configure(tp_check=True)``, off). ``allreduce``:
    "nccl" (the process group's collectives: NCCL on GPUs, gloo on CPU), "symm" (CUDA: symmetric memory), "best"
    (CUDA: the faster of the two, timed per shape on its first call) or "auto" (:func:`resolve_allreduce`; all in
    tp_collectives.py). Meta-device models get random weights, each rank only its shards (see _Placer)."""
    resolve_allreduce(allreduce, tp.device)     # a bad choice fails before any work
    from .runner import native_reason
    reason = native_reason(model)
    if reason is not None:
        raise ValueError(f"tensor parallelism runs on the native runtime, which cannot run this model: {reason}")
    if getattr(model, "_tilespec_tp", None) is not None:
        raise ValueError("this model is already sharded")
    if check is None:
        check = settings.get().tp_check
    native = TensorParallelLlama(model, tp, allreduce=allreduce, check=check, seed=seed)
    embed = model.model.embed_tokens
    head = model.get_output_embeddings()
    moved = {id(embed.weight): native.embed}
    gone = {id(p) for layer in model.model.layers for part in (layer.self_attn, layer.mlp)
            for name, p in part.named_parameters() if "proj" in name}
    if head.weight is not embed.weight:
        gone.add(id(head.weight))
    with torch.no_grad():
        for module in model.modules():
            module.__dict__.pop("_tilespec_fused", None)
            for name, p in list(module.named_parameters(recurse=False)):
                if id(p) in gone:
                    data = torch.empty(p.shape, dtype=p.dtype, device="meta")
                else:
                    data = moved.get(id(p))
                    if data is None:
                        data = moved[id(p)] = native.placed(p)
                setattr(module, name, torch.nn.Parameter(data, requires_grad=False))
            for name, b in list(module.named_buffers(recurse=False)):
                if not b.is_meta:
                    module._buffers[name] = b.to(tp.device)
    model._tilespec_native = native
    model._tilespec_tp = tp
    return model


def tensor_parallel_of(model) -> Optional[TensorParallel]:
    """The :class:`TensorParallel` a model was sharded over by :func:`shard`, or None."""
    return getattr(model, "_tilespec_tp", None)


def check_consistent(model, sequences: Optional[list] = None) -> None:
    """Debug check after a generation: the device-side input comparisons of a ``check=True`` model, and (when
    given) the emitted token lists, equal on every rank. RuntimeError otherwise. A no-op for unsharded models."""
    tp = tensor_parallel_of(model)
    if tp is None:
        return
    native = model._tilespec_native
    if native.check:
        native.raise_on_mismatch()
    if sequences is not None:
        gathered = [None] * tp.size
        dist.all_gather_object(gathered, sequences)
        bad = [r for r, s in enumerate(gathered) if s != gathered[0]]
        if bad:
            raise RuntimeError(f"tensor-parallel ranks {bad} emitted other tokens than rank 0")


__all__ = ["ALLREDUCE", "BEST", "SYMM_MAX_ELEMENTS", "SYMM_VARIANT", "TensorParallel", "TensorParallelLlama",
           "best_all_reduce", "check_consistent", "check_divisible", "check_gpus", "check_launch", "check_target",
           "init_tensor_parallel", "nccl_all_reduce", "resolve_allreduce", "run_rank", "shard", "symm_all_reduce",
           "tensor_parallel_of"]
