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
on two H100s (7.90 vs 8.29 ms, bench/results/tensor-parallel-h100x2.json); larger inputs (prefill) take NCCL.

Same tokens on every rank: the gathered logits are identical on every rank (all-gather and all-reduce results are
bitwise equal across ranks) and the sampling is keyed by (seed, position) through Philox, so every rank draws the
same tokens with no broadcast; drafts (draft models, context drafters) are replicated and run without collectives.
``check=True`` (env ``TILESPEC_TP_CHECK=1``) verifies it: every target forward compares its input tokens and
positions across ranks on the device (graph-safe) and :func:`check_consistent` raises on the host.

Launch: ``torchrun --nproc-per-node N ...``; :func:`init_tensor_parallel` reads the launcher's environment.
"""
from __future__ import annotations

import functools
import os

from tilespec import settings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from .llama import LayerWeights, NativeLlama

ALLREDUCE = ("auto", "nccl", "symm")
SYMM_MAX_ELEMENTS = 1 << 20   # larger sums (prefill) take NCCL: symmetric buffers are kept per shape, never freed
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class TensorParallel:
    """The process's place in a tensor-parallel group: ``rank`` of ``size``, its ``device`` and the ``mesh``."""

    rank: int
    size: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def group_name(self) -> str:
        return self.mesh.get_group().group_name

    @property
    def main(self) -> bool:
        """True on rank 0 (the rank that prints and writes files)."""
        return self.rank == 0


def check_launch(tp: int) -> tuple[int, int, int]:
    """(rank, world size, local rank) from the launcher's environment, with clear errors for a missing launcher or a
    world size other than ``tp`` (every process of the launch is one tensor-parallel rank)."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"the tensor-parallel degree must be an integer >= 1, got {tp!r}")
    missing = [v for v in _LAUNCH_VARS if v not in os.environ]
    if missing:
        if tp == 1:
            return 0, 1, 0
        raise RuntimeError(f"tensor parallelism over {tp} processes needs a launcher that starts one process per "
                           f"GPU ({', '.join(missing)} not set): run `torchrun --nproc-per-node {tp} -m tilespec ...`")
    rank, world, local = (int(os.environ[v]) for v in _LAUNCH_VARS)
    if world != tp:
        raise ValueError(f"tensor-parallel degree {tp} but the launcher started {world} processes: every process is "
                         f"one rank, so pass --nproc-per-node {tp} (or --tp {world})")
    return rank, world, local


def init_tensor_parallel(tp: int, backend: Optional[str] = None) -> TensorParallel:
    """Join (or start) the default process group of a ``torchrun`` launch and build a 1-D mesh of ``tp`` ranks.
    ``backend``: "nccl" with CUDA, else "gloo" (default by device). Each rank uses cuda:LOCAL_RANK when CUDA is
    available."""
    rank, world, local = check_launch(tp)
    cuda = torch.cuda.is_available() and backend != "gloo"
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:        # tp == 1 without a launcher: a group of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29511")
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"), rank=rank, world_size=world,
                                device_id=device if cuda else None)
    elif dist.get_world_size() != world:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks, the launch {world}")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    return TensorParallel(rank=dist.get_rank(), size=world, device=device, mesh=mesh)


def check_divisible(config, tp: int) -> None:
    """ValueError unless ``tp`` divides the query heads, the K/V heads and the MLP width of ``config``."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    width = config.intermediate_size
    bad = [f"{name} {n}" for name, n in (("attention heads", heads), ("key/value heads", kv),
                                         ("MLP width", width)) if n % tp]
    if bad:
        raise ValueError(f"tensor-parallel degree {tp} does not divide the model's {', '.join(bad)}: choose a "
                         f"degree that divides {heads} query heads, {kv} key/value heads and {width} MLP columns")


# ------------------------------------------------------------------------------------------------ the sums
def nccl_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum over the group (functional collective: traced by dynamo, captured in CUDA graphs)."""
    return funcol.all_reduce(x, "sum", group)


SYMM_VARIANT = ["copy"]   # "copy" (one_shot_all_reduce_copy) until it fails once, then "copy_then_reduce"
_SYMM: dict = {}   # (group name, numel, dtype, device) -> [two symmetric buffers, index of the next one]


def _symm_buffers(group: str, x: torch.Tensor) -> list:
    """Two symmetric-memory buffers shaped like ``x`` for this group, made on first use (collective: every rank
    makes them at the same call, which the first, uncaptured run of each shape is: prefill or a graph's warm-up).
    Two, used in turn: a rank may fill the next buffer while a peer still reads the previous one; the one-shot
    kernel's entry barrier keeps the ranks within one sum of each other."""
    key = (group, x.numel(), x.dtype, x.device)
    entry = _SYMM.get(key)
    if entry is None:
        import torch.distributed._symmetric_memory as symm_mem
        if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
            raise RuntimeError("set TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (and NCCL_NVLS_ENABLE=0) before using the "
                               "symmetric-memory all-reduce: NVLink multicast must stay off")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("symmetric buffers must exist before a graph capture (run the shape once first)")
        bufs = []
        for _ in range(2):
            buf = symm_mem.empty(x.numel(), dtype=x.dtype, device=x.device)
            symm_mem.rendezvous(buf, group)
            bufs.append(buf)
        entry = _SYMM[key] = [bufs, 0]
    return entry


@torch.library.custom_op("tilespec::symm_all_reduce", mutates_args=())
def symm_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum over the group by PyTorch's one-shot symmetric-memory all-reduce (every rank loads every peer's buffer
    over NVLink; no multicast); inputs over SYMM_MAX_ELEMENTS by NCCL. CUDA only. Opaque to inductor."""
    if x.numel() > SYMM_MAX_ELEMENTS:
        out = funcol.all_reduce(x.contiguous(), "sum", group)
        return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out
    entry = _symm_buffers(group, x)
    bufs, i = entry
    entry[1] = 1 - i
    flat = x.reshape(-1)
    if SYMM_VARIANT[0] == "copy":     # one kernel: the copy into the symmetric buffer happens inside the all-reduce
        try:
            return torch.ops.symm_mem.one_shot_all_reduce_copy(bufs[i], flat, "sum", group).view(x.shape)
        except (AttributeError, RuntimeError, TypeError):   # an older PyTorch: copy first (one more kernel)
            SYMM_VARIANT[0] = "copy_then_reduce"
    bufs[i].copy_(flat)
    return torch.ops.symm_mem.one_shot_all_reduce(bufs[i], "sum", group).view(x.shape)


@symm_all_reduce.register_fake
def _(x, group):
    return torch.empty_like(x)


def resolve_allreduce(allreduce: str, device: torch.device) -> str:
    """"auto" -> "symm" on CUDA (multicast off: TORCH_SYMM_MEM_DISABLE_MULTICAST is set to 1 when unset), else
    "nccl"; env TILESPEC_TP_ALLREDUCE overrides "auto"."""
    if allreduce not in ALLREDUCE:
        raise ValueError(f"allreduce must be one of {ALLREDUCE}, got {allreduce!r}")
    if allreduce == "auto":
        allreduce = settings.get().tp_allreduce or ("symm" if device.type == "cuda" else "nccl")
        if allreduce == "symm":
            os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if allreduce == "symm" and device.type != "cuda":
        raise ValueError("the symmetric-memory all-reduce needs CUDA devices; use allreduce='nccl'")
    return allreduce


def _reducer(allreduce: str, group: str):
    fn = nccl_all_reduce if allreduce == "nccl" else symm_all_reduce
    return functools.partial(fn, group=group)


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
        self.reduce = _reducer(self.allreduce, tp.group_name)
        self.check = check
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
        full = funcol.all_gather_tensor(local.contiguous(), local.dim() - 1, self.tp.group_name)
        if isinstance(full, funcol.AsyncCollectiveTensor):
            full = full.wait()
        return full[..., :self.vocab] if full.shape[-1] != self.vocab else full

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
    ``check``: compare every forward's inputs across ranks (default: env ``TILESPEC_TP_CHECK=1``). ``allreduce``:
    "nccl" (the process group's collectives: NCCL on GPUs, gloo on CPU), "symm" (CUDA: symmetric memory) or "auto"
    (:func:`resolve_allreduce`). Meta-device models get random weights (see _Placer)."""
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


__all__ = ["ALLREDUCE", "TensorParallel", "TensorParallelLlama", "check_consistent", "check_divisible",
           "check_launch", "init_tensor_parallel", "shard", "tensor_parallel_of"]
