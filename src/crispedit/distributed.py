"""Several processes with ``torch.distributed`` (``torchrun``): who this process is, a process group set up
from torchrun's environment, and the few collectives crispedit uses (sum-reduce, an all-processes-agree
flag, a same-as-rank-0 check, barrier). Every helper is a no-op in a single process, so code paths are the
same with and without torchrun. The transport is torch's own: gloo for CPU tensors, NCCL for CUDA tensors.

    torchrun --standalone --nproc-per-node 2 -m crispedit cache build --model smollm2 --n-cap 512

shards the capability corpus across the processes (see :func:`crispedit.curvature.kfac.collect_lm_kfac`);
only rank 0 writes files and prints.

With ``--shard`` the processes also split the model: :func:`shard_model` puts every decoder block under FSDP2
(``torch.distributed.fsdp.fully_shard``: each process stores a 1/N slice of a block's weights and all-gathers the
block for its forward and backward), keeping the edited weights, the embeddings, the final norm and the LM head
whole on every process. :func:`is_sharded` tells a model so split; :func:`full_state_dict` gathers its weights
for saving.

The module top imports neither torch nor transformers (the command line reads
:func:`launched_world_size` before any argument check); torch is imported by the helpers that need it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor, nn

__all__ = [
    "is_distributed",
    "rank",
    "world_size",
    "is_main",
    "launched_world_size",
    "all_reduce_sum_",
    "all_agree",
    "same_as_main",
    "barrier",
    "broadcast_",
    "process_group_from_env",
    "is_sharded",
    "shard_model",
    "full_state_dict",
]


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


def all_reduce_sum_(t: Tensor) -> Tensor:
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


def same_as_main(value: int) -> bool:
    """True when the integer ``value`` (e.g. a digest of a file every process read) is rank 0's on every process
    (``True`` in a single process). Every process must call it. Used so that all processes start from the same
    state, e.g. "every process read the same committed session state"."""
    if not is_distributed():
        return True
    import torch

    t = torch.tensor([int(value)], dtype=torch.int64, device=_collective_device())
    return all_agree(int(broadcast_(t.clone()).item()) == int(t.item()))


def broadcast_(t: Tensor, src: int = 0) -> Tensor:
    """Overwrite ``t`` on every process with process ``src``'s value, in place (nothing in a single process);
    returns ``t``. Every process must call it with a tensor of the same shape and dtype."""
    if is_distributed():
        _dist().broadcast(t, src=src)
    return t


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

        raise CrispEditError(
            f"cannot join the torchrun process group ({backend}): "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from None
    try:
        yield device
        dist.barrier()
    finally:
        dist.destroy_process_group()


def is_sharded(model: nn.Module) -> bool:
    """Whether some submodule of ``model`` is split across the processes by FSDP2 (:func:`shard_model`)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _move_unmanaged_(model: nn.Module, blocks, keep_ids: set[int], device) -> None:
    """Move to ``device``, in place (the same parameter objects), every parameter and buffer FSDP will not manage:
    those outside ``blocks`` and the kept parameters (``keep_ids``: their ``id``) inside them."""
    import torch

    device = torch.device(device)
    inside = {id(t) for b in blocks for t in (*b.parameters(), *b.buffers())}
    for p in model.parameters():
        if (id(p) not in inside or id(p) in keep_ids) and p.device != device:
            p.data = p.data.to(device)
    for mod in model.modules():
        for k, b in list(mod._buffers.items()):
            if b is not None and b.device != device:
                mod._buffers[k] = b.to(device)


def shard_model(model: nn.Module, keep: Iterable[nn.Parameter], device: str | None = None) -> int:
    """Split ``model``'s decoder blocks across the processes of the default group with FSDP2, in place: each
    block becomes one ``fully_shard`` unit whose parameters are stored as dim-0 slices (padded where the size
    does not divide by the number of processes) and all-gathered for its forward and backward, one block at
    a time. The parameters of ``keep`` (the edited weights) stay whole and plain on every process, as do the
    embeddings, final norm and LM head; so their gradients are local and summed with :func:`all_reduce_sum_`,
    and their projection is the one-process one. Everything moves to ``device`` (default: the CPU; under
    NCCL, a CUDA device). Returns the number of blocks sharded. Every process must call it alike."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from .layers import decoder_blocks

    _, blocks = decoder_blocks(model)
    keep_ids = {id(p) for p in keep}
    device = torch.device(device or "cpu")
    _move_unmanaged_(model, blocks, keep_ids, device)
    mesh = None
    if device.type == "cuda":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (world_size(),))
    for block in blocks:
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=True,
            ignored_params={p for p in block.parameters() if id(p) in keep_ids},
        )
    return len(blocks)


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The whole weights of a (possibly :func:`shard_model`-split) ``model``: name -> CPU tensor on process 0,
    an empty dict on the others. A split parameter is all-gathered one at a time (every process must call
    it), so no process holds more than one whole block weight on its device beyond what it held before."""
    from torch.distributed.tensor import DTensor

    main = is_main()
    out = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if main:
            out[name] = full.detach().cpu()
    return out
