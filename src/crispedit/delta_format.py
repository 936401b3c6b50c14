"""The delta file format (:mod:`crispedit.delta`): its file name, format number and kind, and the torch-free
reader of its safetensors header (8-byte length + JSON).

Torch-free, so ``crispedit delta info`` (:mod:`crispedit.cli.delta`) and the argument checks of the other
``delta`` commands read a delta without importing torch; :mod:`crispedit.delta` writes and loads the same
format with it.
"""

from __future__ import annotations

from pathlib import Path

from .errors import CrispEditError, read_safetensors_header

__all__ = ["DELTA_FILE", "DELTA_FORMAT", "DELTA_KIND", "read_delta_header"]

DELTA_FILE = "delta.safetensors"
DELTA_FORMAT = 1
DELTA_KIND = "crispedit-delta"


def read_delta_header(path: str | Path) -> dict:
    """The crispedit metadata of delta file ``path`` (the JSON stored under ``crispedit_delta`` in its
    safetensors header), with ``tensors`` added (name -> ``{"dtype", "shape", "bytes"}``). Torch-free.
    One-line errors for a missing file, a file that is not safetensors, or a safetensors file that is
    not a crispedit delta of this format."""
    meta, table = read_safetensors_header(path, "delta", "crispedit_delta")
    if meta.get("kind") != DELTA_KIND:
        raise CrispEditError(f"{path} is not a crispedit delta")
    if meta.get("format") != DELTA_FORMAT:
        raise CrispEditError(f"delta {path} has format {meta.get('format')}, this crispedit reads {DELTA_FORMAT}")
    for key in ("base_fingerprint", "edited_fingerprint", "parameters", "dtype"):
        if key not in meta:
            raise CrispEditError(f"delta {path} is malformed: no {key!r}")
    meta["tensors"] = {k: {"dtype": v["dtype"], "shape": v["shape"],
                           "bytes": v["data_offsets"][1] - v["data_offsets"][0]}
                       for k, v in table.items()}
    return meta
