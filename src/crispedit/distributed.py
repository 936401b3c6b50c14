"""Several processes with ``torch.distributed`` (``torchrun``): who this process is, a process group set up
from torchrun's environment, and the few collectives crispedit uses (sum-reduce, an all-processes-agree
flag, barrier). Every helper is a no-op in a single process, so code paths are the same with and without
torchrun. The transport is torch's own: gloo for CPU tensors, NCCL for CUDA tensors.

    torchrun --standalone --nproc-per-node 2 -m crispedit cache build --model smollm2 --n-cap 512

shards the capability corpus across the processes (see :func:`crispedit.curvature.kfac.collect_lm_kfac`);
only rank 0 writes files and prints.

The module top imports neither torch nor transformers (the command line reads
:func:`launched_world_size` before any argument check); torch is imported by the helpers that need it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["is_distributed", "rank", "world_size", "is_main", "launched_world_size", "all_reduce_sum_",
           "all_agree", "barrier", "process_group_from_env"]


def _dist():
    import torch.distributed as dist

    return dist


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group of more than one process is initialised."""
    dist = _dist()
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    return _dist().get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of processes in the default process group (1 without one)."""
    return _dist().get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """Whether this process writes files and prints: rank 0, or the only process."""
    return rank() == 0


def launched_world_size() -> int:
    """``WORLD_SIZE`` set by ``torchrun`` (1 when not launched by it, or when unreadable); reads only the
    environment, imports nothing."""
    try:
        return max(int(os.environ.get("WORLD_SIZE", "1") or 1), 1)
    except ValueError:
        return 1


def _collective_device():
    """Where a small tensor must live for the default group's backend: the current CUDA device under NCCL,
    the CPU otherwise."""
    import torch

    if _dist().get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum_(t: "Tensor") -> "Tensor":
    """Sum ``t`` (any shape and dtype; CPU under gloo, CUDA under NCCL) over all processes, in place;
    returns ``t``. Every process must call it with tensors of the same shape and dtype, in the same order."""
    if is_distributed():
        dist = _dist()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_agree(flag: bool) -> bool:
    """True when ``flag`` is true on every process (a MIN all-reduce of one integer; ``flag`` itself in a
    single process). Every process must call it. Used so that all processes take the same branch, e.g.
    "every process could read the cache file"."""
    if not is_distributed():
        return bool(flag)
    import torch

    dist = _dist()
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(int(t.item()))


def barrier() -> None:
    """Wait until every process gets here (nothing in a single process)."""
    if is_distributed():
        _dist().barrier()


@contextlib.contextmanager
def process_group_from_env(device: str | None) -> Iterator[str | None]:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1) with no process group yet, initialise the default group from
    torchrun's environment (``env://``) — NCCL when ``device`` is CUDA, gloo otherwise — and yield this
    process's device (``cuda`` becomes ``cuda:$LOCAL_RANK``); on a normal exit wait for every process, and
    always destroy the group. Otherwise yield ``device`` unchanged and do nothing."""
    if launched_world_size() <= 1:
        yield device
        return
    import torch

    dist = _dist()
    if dist.is_initialized():
        yield device
        return
    if device is not None and torch.device(device).type == "cuda":
        if torch.device(device).index is None:
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(torch.device(device))
        backend = "nccl"
    else:
        backend = "gloo"
    try:
        dist.init_process_group(backend=backend)
    except (ValueError, RuntimeError) as exc:  # e.g. WORLD_SIZE set by hand without torchrun's MASTER_ADDR
        from .errors import CrispEditError

        raise CrispEditError(f"cannot join the torchrun process group ({backend}): "
                             f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    try:
        yield device
        dist.barrier()
    finally:
        dist.destroy_process_group()
