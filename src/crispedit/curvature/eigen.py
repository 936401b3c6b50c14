"""Eigenbases of K-FAC factors, computed once and cached beside the factors.

A Kronecker projector needs the eigendecompositions ``A = U_in Λ_in U_inᵀ`` and ``S = U_out Λ_out U_outᵀ`` of
each edit layer's factors. They depend on nothing but the factors, so they are computed once per factor set:

* in memory, on the :class:`~crispedit.curvature.factors.KFACFactors` object itself (a second editor or a second
  edit in the same process reuses them), and
* on disk, for factors that came from the content-addressed cache (``factors.source`` holds the file's key and
  write id — its ``uid`` — set by :mod:`crispedit.curvature.cache`): ``<cache root>/eigh/<key>.safetensors`` holds, per
  layer and factor, the eigenvalues (float64, decreasing, clamped at zero) and the eigenvectors (float32
  columns — the precision every projector applies them in). Its metadata records the crispedit version that
  wrote it and the factor file's key and write id; an eigenbasis file of another crispedit version (logged), one
  made for another write of the factor file of the same key (rebuilt with ``--force``), a truncated one or one
  missing a layer is recomputed and replaced atomically. A cache directory that cannot be written only costs the
  saving.

Factors built in memory (a session's factors merged with earlier edits) have no ``source``: their eigenbases
are computed once per object and never written.

The decomposition itself is :func:`crispedit.curvature.masks.eigh_psd` in float64 on every device (on the CPU
through LAPACK; on the factors' device otherwise): a float32 solver's eigenvectors of a factor's wide spectrum mix
the directions a projector masks with those it keeps (its error grows with γ), so no device decomposes in float32.
The eigenvectors are then stored in float32, the precision every projector applies them in, so a projector built
from a cached eigenbasis is the projector built from the factors, bit for bit (the error that rounding costs
against a float64 projector is bounded in tests/curvature/test_projection.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from ..atomic import atomic_save_safetensors
from ..errors import CrispEditError, VersionError
from ..safetensors_io import load_safetensors
from ..versions import check_written_by, stamped
from .masks import eigh_psd

__all__ = ["factor_eigh", "eigen_cache_path", "eigh_device", "eigh_dtype", "EIGEN_FORMAT"]

EIGEN_FORMAT = 1
_META_KEY = "crispedit-eigh"
_log = logging.getLogger("crispedit.curvature")


class FactorSet(Protocol):
    """What :func:`factor_eigh` reads of a factor set (:class:`~crispedit.curvature.factors.KFACFactors`): the
    factors ``A`` and ``S`` by layer, the cache file they came from (``source``) and the memo of their
    eigendecompositions (``_eigh``)."""

    A: dict[str, Tensor]
    S: dict[str, Tensor]
    source: dict
    _eigh: dict


def eigh_device(modules) -> torch.device | None:
    """Where the eigendecompositions of the factors of ``modules`` (name -> linear module) run: the modules' CUDA
    device when their weights live on one (an ``eigh`` there is far faster than on a few CPU cores at large
    widths), else ``None`` (where the factors lie: the CPU)."""
    for m in modules.values():
        w = getattr(m, "weight", None)
        if isinstance(w, Tensor) and w.device.type == "cuda":
            return w.device
    return None


def eigh_dtype(device: torch.device | str) -> torch.dtype:
    """The arithmetic of :func:`factor_eigh`'s decompositions on ``device``: float64 on every device. A float32
    solver (a GPU's, or LAPACK's ``ssyevd``) leaves eigenvector errors of about ``ε₃₂ ‖A‖ / gap``; in a factor's
    wide spectrum they mix masked and kept directions, and the projector drifts from the paper's by far more
    than float32's rounding of its result (most at γ near 1). The cache file records this arithmetic, and a file
    decomposed in another one is decomposed again."""
    return torch.float64


def eigen_cache_path(factors: FactorSet) -> Path | None:
    """Where the eigenbases of ``factors`` are cached: ``<root>/eigh/<key>.safetensors`` for factors loaded from
    or written to ``<root>/kfac/<key>.safetensors``; ``None`` for factors without a cache file (merged, built
    in memory, or read from a file outside a cache root)."""
    src = factors.source
    path, key = src.get("path"), src.get("key")
    if not path or not key:
        return None
    path = Path(path)
    if path.parent.name != "kfac":
        return None
    return path.parent.parent / "eigh" / f"{key}.safetensors"


def _load(
    path: Path, factors: FactorSet, dtype: torch.dtype = torch.float64
) -> dict[tuple[str, str], tuple[Tensor, Tensor]]:
    """The eigenbases stored at ``path`` if this crispedit version wrote the file, in its format, for exactly these
    factors (same key and write id) in the arithmetic ``dtype``, else ``{}`` (another version's file: with a log
    line); a damaged file reads as ``{}``."""
    if not path.is_file():
        return {}
    try:
        meta, tensors = load_safetensors(path, "eigenbasis cache", _META_KEY)
        check_written_by(meta, f"eigenbasis cache {path}", "decomposing again", format=EIGEN_FORMAT)
    except VersionError as exc:
        _log.warning("%s", exc)
        return {}
    except CrispEditError:
        return {}
    if (
        meta.get("factors_key") != factors.source.get("key")
        or meta.get("factors_write") != factors.source.get("write")
        or meta.get("eigh_dtype") != _dtype_name(dtype)
    ):
        return {}
    out = {}
    for key, t in tensors.items():
        name, which, part = key.rsplit("::", 2)
        if part == "evals":
            U = tensors.get(f"{name}::{which}::U")
            if U is not None and U.shape == (t.shape[0], t.shape[0]):
                out[(name, which)] = (t, U)
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _save(
    path: Path,
    factors: FactorSet,
    eig: dict[tuple[str, str], tuple[Tensor, Tensor]],
    dtype: torch.dtype = torch.float64,
) -> None:
    """Write every eigenbasis in ``eig`` (decomposed in ``dtype``) to ``path`` atomically (best effort: an
    unwritable cache is skipped)."""
    tensors = {}
    for (name, which), (evals, U) in eig.items():
        tensors[f"{name}::{which}::evals"] = evals.cpu()
        tensors[f"{name}::{which}::U"] = U.cpu()
    meta = stamped(
        {
            "format": EIGEN_FORMAT,
            "factors_key": factors.source.get("key"),
            "factors_write": factors.source.get("write"),
            "eigh_dtype": _dtype_name(dtype),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    )
    try:
        atomic_save_safetensors(path, tensors, metadata={_META_KEY: json.dumps(meta)})
    except OSError:
        pass  # a read-only cache only costs the saving


def factor_eigh(
    factors: FactorSet,
    names: Iterable[str],
    which: Sequence[str] = ("A", "S"),
    *,
    device: torch.device | str | None = None,
) -> dict[tuple[str, str], tuple[Tensor, Tensor]]:
    """Eigendecompositions of factors ``which`` (``"A"``: ``d_in x d_in``, ``"S"``: ``d_out x d_out``) of layers
    ``names``: ``{(name, which): (evals, U)}`` with ``evals`` float64, decreasing, clamped at zero (length
    ``d``) and ``U`` float32 (``d x d``, columns the matching eigenvectors). Each is computed at most once per
    factor set (kept on ``factors`` and, for cached factors, in the eigenbasis cache file of
    :func:`eigen_cache_path`). ``device``: where to decompose what is not cached (default: where the factor
    lies; a CUDA device runs ``torch.linalg.eigh`` there), in float64 on every device (:func:`eigh_dtype`). A cache
    file decomposed in another arithmetic is decomposed again and rewritten, so a projector from a cached eigenbasis
    equals the one from a float64 decomposition of the factors."""
    wanted = [(n, w) for n in names for w in which]
    for n, w in wanted:
        if w not in ("A", "S"):
            raise ValueError(f"which must be 'A' or 'S', not {w!r}")
        if n not in (factors.A if w == "A" else factors.S):
            raise CrispEditError(f"the curvature factors hold no {w} factor for layer {n}")
    memo = factors._eigh
    missing = [k for k in wanted if k not in memo]
    path = eigen_cache_path(factors) if missing else None
    if missing:
        n, w = missing[0]
        dtype = eigh_dtype(device if device is not None else (factors.A if w == "A" else factors.S)[n].device)
    if path is not None:
        stored = _load(path, factors, dtype)
        memo.update({k: v for k, v in stored.items() if k not in memo})
        missing = [k for k in wanted if k not in memo]
    if missing:
        for n, w in missing:
            M = (factors.A if w == "A" else factors.S)[n]
            if device is not None:
                M = M.to(device)
            evals, U = eigh_psd(M, dtype)
            # Kept in float32 (after the float64 decomposition): every projector casts its bases to float32 anyway
            # (KroneckerProjector's dtype), so float64 here would change no projection and double the memory and the
            # cache file of each d x d basis. The rounding's cost against a float64
            # projector is bounded by tests/curvature/test_projection.py.
            memo[(n, w)] = (evals.to(torch.float64).cpu(), U.to(torch.float32).cpu())
        if path is not None:
            _save(path, factors, memo, dtype)
    return {k: memo[k] for k in wanted}
