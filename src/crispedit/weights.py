"""A model's weights: a parameter by its full name, values set for a block and restored bit for bit, and the
fingerprint that identifies them (what caches, sessions and deltas are keyed by).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .errors import CrispEditError

__all__ = ["parameter", "restoring", "with_weights", "FINGERPRINT_PREFIX", "weight_fingerprint"]


def parameter(model: nn.Module, name: str) -> torch.Tensor:
    """The parameter named ``name`` (e.g. ``model.layers.1.mlp.down_proj.weight``). Under a peft LoRA adapter
    ``<module>.weight`` still names the wrapped base layer's weight (peft's ``weight`` property), so a LoRA session's
    stored names resolve while its adapter trains."""
    try:
        return model.get_parameter(name)
    except AttributeError:
        raise CrispEditError(f"no parameter named {name!r} in this {type(model).__name__}") from None


@contextlib.contextmanager
def restoring(params: dict[str, torch.Tensor]) -> Iterator[None]:
    """On exit, however the block ends, each tensor of ``params`` (name -> parameter) gets back the value it had on
    entry, bit for bit."""
    saved = {n: p.detach().clone() for n, p in params.items()}
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])


@contextlib.contextmanager
def with_weights(model: nn.Module, weights: dict[str, torch.Tensor] | None) -> Iterator[None]:
    """Within the block the parameters of ``model`` named in ``weights`` (full name -> tensor of the parameter's
    shape, any device or dtype; :func:`parameter` resolves the names) hold those values; on exit each gets back the
    value it had, bit for bit (:func:`restoring`). ``None`` or empty: nothing changes."""
    if not weights:
        yield
        return
    params = {n: parameter(model, n) for n in weights}
    with restoring(params):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(weights[n])
        yield


FINGERPRINT_PREFIX = "xxh3-"  # weight_fingerprint's digests name their hash


def _hash_weights(model: nn.Module, h) -> str:
    """Feed ``h`` (a hashlib-style object) the model type and every parameter and buffer in name order (name,
    shape, dtype, then its bytes; bfloat16 as 16-bit integers) and return its hex digest. A weight split across
    processes (:func:`crispedit.distributed.shard_model`) is gathered whole first, one at a time (every process
    must call it), so a split model has the fingerprint of the same weights in one process."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without torch.distributed: nothing can be split
        DTensor = ()  # noqa: N806

    h.update(str(getattr(getattr(model, "config", None), "model_type", type(model).__name__)).encode())
    for name, t in sorted(model.state_dict().items()):
        if isinstance(t, DTensor):
            t = t.full_tensor()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        data = t.detach().cpu().contiguous()
        if data.dtype == torch.bfloat16:
            data = data.view(torch.int16)
        if data.numel():
            h.update(memoryview(data.numpy().reshape(-1)).cast("B"))  # the bytes of tobytes(), without the copy
    return h.hexdigest()


def weight_fingerprint(model: nn.Module) -> str:
    """Identity of the model's weights: ``"xxh3-"`` and the 32-hex-digit XXH3-128 digest of the model type and
    every parameter and buffer (names, shapes, dtypes and bytes). The same weights loaded from different paths
    give the same fingerprint; any changed byte gives another. XXH3 (the hash Hugging Face ``datasets`` keys its
    caches with) reads memory at its bandwidth, where a cryptographic hash takes minutes for an 8B model. Not a
    defence against crafted collisions: it names caches, it does not
    authenticate them."""
    import xxhash

    return FINGERPRINT_PREFIX + _hash_weights(model, xxhash.xxh3_128())
