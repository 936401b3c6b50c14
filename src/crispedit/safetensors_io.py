"""Checked reads of crispedit's safetensors files (curvature caches, deltas, MEND networks, checkpoints):
the header and crispedit's metadata read without torch, every defect a one-line
:class:`~crispedit.errors.CrispEditError` naming the file.
"""

from __future__ import annotations

import json
import os
import struct

from .errors import CrispEditError
from .paths import check_input_file

_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the size of a file's JSON header


def read_safetensors_header(path: str | os.PathLike, kind: str, key: str | None) -> tuple[dict, dict[str, dict]]:
    """The crispedit metadata and the tensor table of safetensors file ``path``, read without torch.

    The file is ``<8-byte little-endian n><n bytes of JSON header><data>``; the header maps each tensor
    name to ``{"dtype", "shape", "data_offsets"}`` and ``"__metadata__"`` to a ``str -> str`` map, in which
    crispedit stores its JSON under ``key``.

    Args:
        path: The file.
        kind: What the file should be, for the messages (``"curvature cache"``, ``"MEND network"``,
            ``"delta"``): they read ``"<kind> file <path> ..."`` and ``"<path> is not a crispedit <kind>"``.
        key: The metadata entry holding crispedit's JSON (e.g. ``"crispedit_delta"``); ``None``: return the
            raw ``str -> str`` metadata map, whatever it holds.

    Returns:
        ``(meta, table)``: the JSON object under ``key`` (or the raw map) and, per tensor name, its header
        entry (``data_offsets``: ``[begin, end)`` in bytes from the start of the data section).

    Raises:
        CrispEditError: one line, for a missing, unreadable or directory path, a file that is not
            safetensors or whose data section does not match its header (truncated), and a file without
            valid ``key`` metadata (a foreign file).
    """
    what = f"{kind} file"
    path = check_input_file(path, what)
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or n > size - 8:
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(fh.read(n).decode("utf-8"))
        if not isinstance(header, dict) or not isinstance(header.get("__metadata__") or {}, dict):
            raise ValueError("header is not an object")
        table = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((int(v["data_offsets"][1]) for v in table.values()), default=0)
        if end != size - 8 - n:
            raise ValueError(f"the header describes {end} bytes of data, the file holds {size - 8 - n}")
    except (ValueError, OSError, KeyError, TypeError, IndexError) as exc:  # UnicodeDecodeError, JSONDecodeError
        raise CrispEditError(f"{what} {path} is not a safetensors file, or is truncated or corrupt ({exc})") from None
    meta_map = header.get("__metadata__") or {}
    if key is None:
        return meta_map, table
    raw_meta = meta_map.get(key)
    if raw_meta is None:
        raise CrispEditError(f"{path} is not a crispedit {kind} (no {key} metadata)")
    try:
        meta = json.loads(raw_meta)
    except (TypeError, json.JSONDecodeError):
        meta = None
    if not isinstance(meta, dict):
        raise CrispEditError(f"{what} {path} has corrupt metadata")
    return meta, table


def load_safetensors(path: str | os.PathLike, kind: str, key: str | None) -> tuple[dict, dict]:
    """The crispedit metadata and all tensors of safetensors file ``path`` (loaded on the CPU).

    The header is checked first by :func:`read_safetensors_header` (same ``kind`` / ``key`` and errors);
    the tensors are then read with safetensors' ``safe_open`` (this imports torch).

    Returns:
        ``(meta, tensors)``: the JSON object under ``key`` (the raw metadata map for ``None``) and tensor
        name -> ``torch.Tensor`` with the stored shape and dtype.

    Raises:
        CrispEditError: one line, as :func:`read_safetensors_header`, or ``"<kind> file <path> is truncated
            or corrupt (...)"`` when a tensor cannot be read.
    """
    meta, _ = read_safetensors_header(path, kind, key)
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as exc:  # safetensors raises SafetensorError / OSError on damaged files
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise CrispEditError(f"{kind} file {path} is truncated or corrupt ({first})") from None
    return meta, tensors
