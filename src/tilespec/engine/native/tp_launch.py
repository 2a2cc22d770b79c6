"""Launching tensor parallelism: the checks that run before any weight loads, joining a ``torchrun`` launch, and
ending every rank when one fails.

Before weights (every entry point: ``tilespec generate --tp``, ``tilespec.generate(tp=)``, ``bench e2e --tp``):
:func:`init_tensor_parallel` refuses a missing launcher, a world size other than the degree and a host with fewer
GPUs than the degree; ``api.load_pair`` calls :func:`check_target` with the target's name, which reads the model's
configuration alone (``config.json`` of a folder, a cached registry model or a hub id; a GGUF file's metadata) and
refuses a degree that does not divide the query heads, the K/V heads or the MLP width.

One rank's failure ends every rank: the process group has a timeout (``timeout_s``, 600 s by default: a rank that
waits longer than that in a collective raises), an uncaught exception on a rank is logged with its rank and ends the
process at once (``os._exit(1)``: no interpreter shutdown that could wait on a collective), and :func:`run_rank` does
the same for a rank's main function. ``torchrun`` then stops the other ranks; without it, peers waiting in a gloo
collective see the closed connection and fail, and NCCL peers fail at the timeout.
"""
from __future__ import annotations

import datetime
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
TIMEOUT_S = 600.0


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


def check_gpus(tp: int, local_rank: int) -> None:
    """ValueError when this host shows fewer CUDA devices than the ranks it runs (one GPU per rank, cuda:LOCAL_RANK).
    No CUDA at all is not an error: the ranks then run on CPU over gloo."""
    if not torch.cuda.is_available():
        return
    count = torch.cuda.device_count()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", tp))
    if count < local_world or local_rank >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise ValueError(f"tensor-parallel degree {tp} needs {local_world} GPUs on this host, one per rank, but "
                         f"{count} {'is' if count == 1 else 'are'} visible{seen}: pass --tp {count} and "
                         f"--nproc-per-node {count} or fewer, or make more GPUs visible")


def init_tensor_parallel(tp: int, backend: Optional[str] = None, timeout_s: float = TIMEOUT_S) -> TensorParallel:
    """Join (or start) the default process group of a ``torchrun`` launch and build a 1-D mesh of ``tp`` ranks.
    ``backend``: "nccl" with CUDA, else "gloo" (default by device). Each rank uses cuda:LOCAL_RANK when CUDA is
    available. ``timeout_s``: how long a collective waits for the other ranks before it raises. With more than one
    rank, an uncaught exception ends this process at once after logging (see the module docstring)."""
    rank, world, local = check_launch(tp)
    cuda = torch.cuda.is_available() and backend != "gloo"
    if cuda:
        check_gpus(tp, local)
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:        # tp == 1 without a launcher: a group of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29511")
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"), rank=rank, world_size=world,
                                device_id=device if cuda else None, timeout=datetime.timedelta(seconds=timeout_s))
    elif dist.get_world_size() != world:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks, the launch {world}")
    if world > 1:
        end_rank_on_uncaught_exception()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    return TensorParallel(rank=dist.get_rank(), size=world, device=device, mesh=mesh)


# ------------------------------------------------------------------------------------------------ failures
def exit_rank(err: BaseException, code: int = 1) -> None:
    """Log ``err`` with this process's rank and end the process now (``os._exit``: no interpreter shutdown, which
    could wait on a collective the other ranks never finish). Never returns."""
    rank = os.environ.get("RANK", "?")
    try:
        tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        sys.stderr.write(f"[tilespec rank {rank}] failed, ending this rank (exit {code}):\n{tb}")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(code)


def _excepthook(kind, err, tb) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, err, tb)
        os._exit(130)
    exit_rank(err.with_traceback(tb))


def end_rank_on_uncaught_exception() -> None:
    """Install the hook that ends this rank on an uncaught exception (idempotent)."""
    if sys.excepthook is not _excepthook:
        sys.excepthook = _excepthook


def run_rank(main: Callable[[], object]) -> object:
    """Run a rank's ``main``; on an exception (SystemExit with a non-zero code included), log it and end the process
    at once so the launcher stops the other ranks (see :func:`exit_rank`). Returns ``main``'s result."""
    try:
        return main()
    except SystemExit as err:
        if err.code in (None, 0):
            raise
        exit_rank(err, err.code if isinstance(err.code, int) else 1)
    except BaseException as err:  # noqa: BLE001 - every failure must end the rank, not hang its peers
        exit_rank(err)


# ------------------------------------------------------------------------------------------------ the model
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


def target_config(name):
    """The transformers configuration of a target named as ``tilespec.models.load`` accepts it, read without its
    weights: a folder's ``config.json``, a cached registry model's (its converted copy, else its GGUF metadata), a
    GGUF file's metadata or a hub id's ``config.json``. None when it cannot be read so (a registry model not fetched
    yet, a hub id offline): the sharding checks the loaded model then."""
    from transformers import AutoConfig

    from tilespec.models.cache import is_cached, model_dir
    from tilespec.models.registry import REGISTRY, parse_model_spec
    spec = str(name) if isinstance(name, Path) else parse_model_spec(str(name)).name
    try:
        if spec in REGISTRY:
            entry = REGISTRY[spec]
            if entry.kind != "gguf" or not is_cached(spec):
                return None
            folder = model_dir(spec)
            converted = sorted(folder.glob("hf-*/config.json"))
            if converted:
                return AutoConfig.from_pretrained(str(converted[0].parent))
            return AutoConfig.from_pretrained(str(folder), gguf_file=entry.source_name)
        path = Path(spec).expanduser()
        if path.is_dir():
            return AutoConfig.from_pretrained(str(path)) if (path / "config.json").is_file() else None
        if path.is_file() and path.suffix == ".gguf":
            return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        if path.exists() or "/" not in spec:
            return None
        return AutoConfig.from_pretrained(spec)
    except (OSError, ValueError, ImportError):
        return None


def check_target(name, tp: int) -> None:
    """Before loading the target ``name``'s weights: ValueError when ``tp`` does not divide its heads or MLP width
    (from its configuration alone, :func:`target_config`); nothing when the configuration cannot be read."""
    config = target_config(name)
    if config is None:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "num_attention_heads", None) is None or getattr(text, "intermediate_size", None) is None:
        return          # not a Llama-family decoder: shard() names what the native runtime cannot run
    check_divisible(text, tp)


__all__ = ["TIMEOUT_S", "TensorParallel", "check_divisible", "check_gpus", "check_launch", "check_target",
           "end_rank_on_uncaught_exception", "exit_rank", "init_tensor_parallel", "run_rank", "target_config"]
