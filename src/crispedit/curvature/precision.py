"""The arithmetic of the projection's rotations on a GPU: float32, or TF32 tensor cores
(``EditConfig.projection_precision``; the CPU always runs float32). :func:`rotation_precision` switches TF32 on for
a block and restores the setting after; :func:`tf32_gemms` says whether a tensor's GEMMs run in TF32 now.
:data:`TF32_FULL_FORM_RATIO` is where a projector takes the full rotation in TF32 over its low-rank form in
float32 (:mod:`.projection`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["ROTATION_PRECISIONS", "TF32_FULL_FORM_RATIO", "rotation_precision", "tf32_gemms"]


ROTATION_PRECISIONS = ("fp32", "tf32")  # the projection's GEMMs on a GPU (EditConfig.projection_precision)


# The full form in TF32 runs where its FLOPs are at most this many times the low-rank form's: TF32 GEMMs run several
# times faster than float32's, so up to there the full form costs less (docs/benchmarks.md); elsewhere the low-rank
# form runs in float32.
TF32_FULL_FORM_RATIO = 4.0


_UNCHANGED = object()


def _set_tf32(on: bool) -> object:
    """Switch CUDA's float32 matmuls to TF32 (``on``) or full float32 unless they already are (then nothing is
    set, so a process that configured TF32 through torch's earlier ``allow_tf32`` flag never sees the two APIs
    mixed in the default case); returns what :func:`_restore_tf32` needs."""
    if _cuda_tf32() == on:
        return _UNCHANGED
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9
        before, matmul.fp32_precision = matmul.fp32_precision, ("tf32" if on else "ieee")
    else:  # pragma: no cover - older torch
        before, matmul.allow_tf32 = matmul.allow_tf32, on
    return before


def _restore_tf32(before: object) -> None:
    if before is _UNCHANGED:
        return
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = before
    else:  # pragma: no cover - older torch
        matmul.allow_tf32 = before


def _cuda_tf32() -> bool:
    """Whether CUDA's float32 matmuls run in TF32 now (the per-backend setting, else the process-wide
    ``torch.get_float32_matmul_precision()``)."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        mode = matmul.fp32_precision
        if mode == "none":
            return torch.get_float32_matmul_precision() != "highest"
        return mode == "tf32"
    return bool(matmul.allow_tf32)  # pragma: no cover - older torch


@contextlib.contextmanager
def rotation_precision(mode: str, device: torch.device | str) -> Iterator[None]:
    """The float32 matrix products inside the block run in ``mode`` when ``device`` is a CUDA device:
    ``"fp32"`` (full float32, whatever the process set globally) or ``"tf32"`` (tensor cores: inputs rounded
    to a 10-bit mantissa, float32 accumulation). On other devices nothing changes. The previous setting is
    restored on exit. Operands, results, factors and eigenbases stay float32 tensors either way."""
    if mode not in ROTATION_PRECISIONS:
        raise ValueError(f"rotation precision must be one of {', '.join(ROTATION_PRECISIONS)}, not {mode!r}")
    if torch.device(device).type != "cuda":
        yield
        return
    before = _set_tf32(mode == "tf32")
    try:
        yield
    finally:
        _restore_tf32(before)


def tf32_gemms(X: Tensor) -> bool:
    """Whether float32 matrix products on ``X``'s device run in TF32 now (a CUDA tensor with TF32 allowed)."""
    return X.is_cuda and _cuda_tf32()
