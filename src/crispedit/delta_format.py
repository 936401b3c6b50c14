"""The delta file format (:mod:`crispedit.delta`): its file name, format number and kind, the torch-free
reader of its safetensors header (8-byte length + JSON) and the check of a LoRA rank against it.

Torch-free, so ``crispedit delta info`` (:mod:`crispedit.cli.delta`) and the argument checks of the other
``delta`` commands read a delta without importing torch; :mod:`crispedit.delta` writes and loads the same
format with it.
"""

from __future__ import annotations

from pathlib import Path

from .checks import check_positive_int
from .errors import CrispEditError
from .safetensors_io import read_safetensors_header
from .versions import check_written_by

__all__ = ["DELTA_FILE", "DELTA_FORMAT", "DELTA_KIND", "read_delta_header", "lora_rank_limit", "check_lora_rank"]

DELTA_FILE = "delta.safetensors"
DELTA_FORMAT = 1
DELTA_KIND = "crispedit-delta"


def read_delta_header(path: str | Path) -> dict:
    """The crispedit metadata of delta file ``path`` (the JSON stored under ``crispedit_delta`` in its
    safetensors header), with ``tensors`` added (name -> ``{"dtype", "shape", "bytes"}``). Torch-free.
    One-line errors for a missing file, a file that is not safetensors, a safetensors file that is not a
    crispedit delta, or a delta another crispedit version wrote or of another format
    (:func:`~crispedit.versions.check_written_by`)."""
    meta, table = read_safetensors_header(path, "delta", "crispedit_delta")
    if meta.get("kind") != DELTA_KIND:
        raise CrispEditError(f"{path} is not a crispedit delta")
    check_written_by(meta, f"delta {path}", "write it again with this crispedit", format=DELTA_FORMAT)
    for key in ("base_fingerprint", "edited_fingerprint", "parameters", "dtype"):
        if key not in meta:
            raise CrispEditError(f"delta {path} is malformed: no {key!r}")
    meta["tensors"] = {
        k: {"dtype": v["dtype"], "shape": v["shape"], "bytes": v["data_offsets"][1] - v["data_offsets"][0]}
        for k, v in table.items()
    }
    return meta


def lora_rank_limit(meta: dict) -> int:
    """The largest rank a LoRA adapter of delta ``meta``'s changed matrices can use: the largest
    ``min(d_out, d_in)`` among its 2-D tensors (a higher rank only pads every factor with zeros); 0 when it
    changed no matrix. Torch-free (the header's shapes)."""
    shapes = [p.get("shape") for p in (meta.get("parameters") or {}).values() if isinstance(p, dict)]
    return max((min(int(d) for d in s) for s in shapes if isinstance(s, list) and len(s) == 2), default=0)


def check_lora_rank(name: str, rank, meta: dict, path: str | Path) -> int:
    """``rank`` as a LoRA rank for delta ``meta`` (of file ``path``): a positive integer no larger than
    :func:`lora_rank_limit`; one-line :class:`CrispEditError` naming ``name`` (e.g. ``--rank``) otherwise, before
    any work (a huge rank would otherwise end in an allocation or overflow error)."""
    rank = check_positive_int(name, rank)
    limit = lora_rank_limit(meta)
    if limit == 0:
        raise CrispEditError(f"delta {path} changes no weight matrix; there is nothing to export as a LoRA adapter")
    if rank > limit:
        raise CrispEditError(
            f"{name} {rank} is more than a LoRA adapter of the layers of delta {path} can hold: at "
            f"most {limit} (min(d_out, d_in) of its largest changed matrix)"
        )
    return rank
