"""Content-addressed on-disk cache of K-FAC factors.

A cache entry is one safetensors file ``<root>/kfac/<key>.safetensors`` whose header metadata holds a
JSON description of how it was made. The key is a digest of everything that changes the numbers:
the model weight fingerprint, the layer names, the corpus digest, the number of texts, the maximum
length, the label mode, the seed, the statistics dtype and the factor-format version (not the number of
processes that collected the factors: a multi-process build gives the one-process factors). Files are
written to a temporary name and renamed, so a reader sees either nothing or a complete file; under
``torch.distributed`` only rank 0 writes. Every
load re-checks the metadata against what the caller expects, so a file is never silently used for
another model or configuration, and a truncated or corrupt file is reported as such. Each file records the
crispedit version that wrote it: :func:`load_factors` refuses another version's file in one line, and
:func:`get_or_build_factors` takes such an entry for a miss and rebuilds it (a cache is a cache), saying so in a
log line.

Two kinds share the format, the key and the checks: ``kfac`` (capability K-FAC factors ``A`` and ``S``) and
``input`` (``A = E[k kᵀ]`` alone, forward only, no labels: MEMIT / AlphaEdit's key covariance, see
:func:`~crispedit.curvature.kfac.collect_lm_input_covariance`); ``kind`` is part of the spec, hence of the key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..atomic import atomic_save_safetensors
from ..distributed import all_agree, barrier, is_main, world_size
from ..errors import CrispEditError, VersionError
from ..safetensors_io import load_safetensors
from ..versions import check_written_by, stamped
from .factors import KFACFactors
from .kfac import collect_lm_input_covariance, collect_lm_kfac
from .lm_backward import LabelMode
from .modes import CACHE_KINDS

__all__ = [
    "CurvatureSpec",
    "KINDS",
    "cache_key",
    "save_factors",
    "load_factors",
    "get_or_build_factors",
    "layer_shapes",
    "FORMAT_VERSION",
]

_log = logging.getLogger("crispedit.curvature")
FORMAT_VERSION = 1
KINDS = CACHE_KINDS  # what a cache entry holds: K-FAC factors A and S, or the input covariance A alone


@dataclass(frozen=True)
class CurvatureSpec:
    """Everything that determines a set of capability K-FAC factors (besides the weights)."""

    model_fingerprint: str
    layers: tuple[str, ...]
    corpus_digest: str
    n_texts: int
    max_len: int
    label_mode: str
    seed: int
    stat_dtype: str = "float32"
    model_dtype: str = "float32"
    format_version: int = FORMAT_VERSION
    kind: str = "kfac"  # KINDS; input covariances have label_mode "none"

    def as_dict(self) -> dict:
        """The spec as a JSON-ready dict (``layers`` as a list): what factor files store and the key hashes."""
        d = asdict(self)
        d["layers"] = list(self.layers)
        return d


def cache_key(spec: CurvatureSpec) -> str:
    """24-hex-digit SHA-256 of the spec's sorted JSON: the content address of a factor file in the cache."""
    blob = json.dumps(spec.as_dict(), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def save_factors(path: str | Path, factors: KFACFactors, spec: CurvatureSpec, extra: dict | None = None) -> Path:
    """Write ``factors`` (A: ``d_in x d_in``, S: ``d_out x d_out`` per layer, float32) to ``path`` as safetensors
    atomically, with this crispedit's version, the spec, its key, the token count, a UTC timestamp, a random ``uid``
    (which write this is: what cached eigenbases are matched against) and ``extra`` as metadata; returns ``path``."""
    path = Path(path)
    meta = stamped(
        {
            "spec": spec.as_dict(),
            "key": cache_key(spec),
            "n_tokens": factors.n_tokens,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "uid": uuid.uuid4().hex,
            **(extra or {}),
        }
    )
    atomic_save_safetensors(path, factors.to_tensors(), metadata={"crispedit": json.dumps(meta)})
    return path


def _source_of(path: Path) -> dict:
    """``key`` and ``write`` (its ``uid``) of the factor file at ``path`` (read from its header; ``{}`` if
    unreadable)."""
    from ..safetensors_io import read_safetensors_header

    try:
        meta, _ = read_safetensors_header(path, "curvature cache", "crispedit")
    except CrispEditError:
        return {}
    return {"key": meta.get("key"), "write": meta.get("uid")}


def _show(v) -> str:
    if isinstance(v, (list, tuple)):
        return f"{len(v)} layers {list(v)[:2]}{'…' if len(v) > 2 else ''}"
    if isinstance(v, str) and len(v) > 16:
        return v[:12] + "…"
    return repr(v)


def load_factors(
    path: str | Path,
    expect: CurvatureSpec | None = None,
    *,
    model_fingerprint: str | None = None,
    layers: Sequence[str] | None = None,
    shapes: dict[str, tuple[int, int]] | None = None,
) -> KFACFactors:
    """Load factors, refusing a file made for another model, other layers or another configuration.

    ``expect`` is the full spec the caller would build (every field is compared: model fingerprint,
    layers, corpus digest, number of texts, max length, label mode, seed, dtypes, format); without it only
    ``model_fingerprint`` / ``layers`` are checked. ``shapes`` (layer -> ``(d_out, d_in)`` of its weight)
    checks each factor's size: A is ``d_in x d_in``, S is ``d_out x d_out``. A file another crispedit version
    wrote is a :class:`~crispedit.errors.VersionError` (one line)."""
    path = Path(path)
    meta, tensors = load_safetensors(path, "curvature cache", "crispedit")
    check_written_by(meta, f"curvature cache {path}", "rebuild it with `crispedit cache build`")
    spec = meta.get("spec", {})
    if not isinstance(spec, dict):
        raise CrispEditError(f"curvature cache file {path} has corrupt metadata (no spec)")
    fp = expect.model_fingerprint if expect else model_fingerprint
    if fp is not None and spec.get("model_fingerprint") != fp:
        raise CrispEditError(
            f"curvature cache {path} was built for another model (fingerprint "
            f"{str(spec.get('model_fingerprint'))[:12]}…, "
            f"this model is {fp[:12]}…)"
        )
    want_layers = list(expect.layers) if expect else (list(layers) if layers is not None else None)
    kind = spec.get("kind", "kfac")
    if expect is not None and kind != expect.kind:
        raise CrispEditError(
            f"curvature cache {path} holds {kind} statistics, not {expect.kind} "
            "(build it with `crispedit cache build --kind " + expect.kind + "`)"
        )
    if kind not in KINDS:
        raise CrispEditError(f"curvature cache {path} has an unknown kind {kind!r}")
    if want_layers is not None and spec.get("layers") != want_layers:
        raise CrispEditError(f"curvature cache {path} covers layers {spec.get('layers')}, not {want_layers}")
    if expect is not None:
        diff = [k for k, v in expect.as_dict().items() if spec.get(k) != v and k != "model_fingerprint"]
        if diff:
            detail = ", ".join(
                f"{k}={_show(spec.get(k))} (asked: {_show(v)})" for k, v in expect.as_dict().items() if k in diff
            )
            raise CrispEditError(
                f"curvature cache {path} was built with a different configuration: {detail}; "
                "rebuild it with `crispedit cache build` and the same flags as the edit"
            )
    factors = KFACFactors.from_tensors(tensors, int(meta.get("n_tokens", 0)), meta)
    factors.source = {"path": str(path), "key": meta.get("key"), "write": meta.get("uid")}
    has_s = kind == "kfac"
    for name in spec.get("layers", []):
        if name not in factors.A or (has_s and name not in factors.S):
            raise CrispEditError(f"curvature cache {path} is incomplete: no factors for {name}")
        for fk, t in (("A", factors.A[name]),) + ((("S", factors.S[name]),) if has_s else ()):
            if t.dim() != 2 or t.shape[0] != t.shape[1] or not torch.isfinite(t).all():
                raise CrispEditError(f"curvature cache {path} is corrupt: bad {fk} factor for {name}")
        if shapes is not None and name in shapes:
            d_out, d_in = shapes[name]
            if factors.A[name].shape[0] != d_in or (has_s and factors.S[name].shape[0] != d_out):
                got_out = factors.S[name].shape[0] if has_s else "?"
                raise CrispEditError(
                    f"curvature cache {path}: factors for {name} are for a {got_out}x"
                    f"{factors.A[name].shape[0]} layer, this layer is {d_out}x{d_in}"
                )
    return factors


def _cached(path: Path, spec: CurvatureSpec, layers: dict[str, nn.Module]) -> KFACFactors | None:
    """The factors the cache entry ``path`` holds for ``spec`` and ``layers``, or ``None``: no entry, one another
    crispedit version wrote (logged) or a damaged one — all rebuilt by the caller (and replaced atomically)."""
    if not path.is_file():
        return None
    try:
        return load_factors(path, spec, shapes=layer_shapes(layers))
    except VersionError as exc:
        _log.warning("%s; rebuilding the entry", exc)
    except CrispEditError:
        pass
    return None


def _collect(
    model: nn.Module,
    tokenizer,
    layers: dict[str, nn.Module],
    texts: Sequence[str] | Callable[[], tuple[Sequence, Sequence[int] | None]],
    spec: CurvatureSpec,
    batch_size: int,
    stat_dtype: torch.dtype,
    progress: bool | None,
) -> KFACFactors:
    """Collect the factors ``spec`` names on ``texts`` (or what the function ``texts`` returns, see
    :func:`get_or_build_factors`): K-FAC (:func:`~crispedit.curvature.kfac.collect_lm_kfac`) or, for
    ``spec.kind == "input"``, the layers' input covariances only."""
    loss_from = None
    if callable(texts):
        texts, loss_from = texts()
    _log.info(
        "capability curvature (%s): collecting over %d texts of <= %d tokens", spec.kind, len(texts), spec.max_len
    )
    common = dict(
        max_len=spec.max_len, batch_size=batch_size, stat_dtype=stat_dtype, progress=progress, loss_from=loss_from
    )
    if spec.kind == "input":
        return collect_lm_input_covariance(model, tokenizer, texts, layers, **common)
    return collect_lm_kfac(
        model, tokenizer, texts, layers, label_mode=LabelMode(spec.label_mode), seed=spec.seed, **common
    )


def get_or_build_factors(
    model: nn.Module,
    tokenizer,
    layers: dict[str, nn.Module],
    texts: Sequence[str] | Callable[[], tuple[Sequence, Sequence[int] | None]],
    spec: CurvatureSpec,
    *,
    root: str | Path,
    batch_size: int = 8,
    stat_dtype: torch.dtype = torch.float32,
    force: bool = False,
    progress: bool | None = None,
) -> tuple[KFACFactors, dict]:
    """Return cached factors for ``spec`` or collect and cache them. ``info`` says which happened. ``texts``: the
    corpus, or a function returning ``(sequences, loss_from)`` (texts or token-id sequences, and the first
    counted position of each, as :func:`~crispedit.curvature.kfac.collect_lm_kfac` takes them) called only when
    the factors are collected.

    Under ``torch.distributed`` (several processes, e.g. ``torchrun``) every process calls it with the same
    arguments: the file is used only if every process could read it (otherwise all of them collect, and a
    cache root that is not shared by all processes means no hits); the collection is sharded across the
    processes (:func:`~crispedit.curvature.kfac.collect_lm_kfac`), only rank 0 writes the file, and every
    process returns, with the same factors, once it is written. An entry another crispedit version wrote is a miss:
    it is rebuilt (and replaced), with a log line saying so."""
    path = Path(root) / "kfac" / f"{cache_key(spec)}.safetensors"
    t0 = time.perf_counter()
    factors = None if force else _cached(path, spec, layers)
    if all_agree(factors is not None):  # every process takes the same branch (collectives follow)
        _log.info("capability curvature: cached (%s)", path.name)
        return factors, {
            "path": str(path),
            "hit": True,
            "seconds": time.perf_counter() - t0,
            "spec": factors.meta.get("spec"),
        }
    factors = _collect(model, tokenizer, layers, texts, spec, batch_size, stat_dtype, progress)
    seconds = time.perf_counter() - t0
    _log.info("capability curvature: collected in %.0f s", seconds)
    if is_main():
        save_factors(path, factors, spec, extra={"collect_seconds": seconds, "processes": world_size()})
        factors.source = {"path": str(path), **_source_of(path)}
    barrier()
    return factors, {"path": str(path), "hit": False, "seconds": seconds, "spec": spec.as_dict()}


def layer_shapes(layers: dict[str, nn.Module]) -> dict[str, tuple[int, int]]:
    """``(d_out, d_in)`` of each layer's weight (GPT-2's transposed Conv1D included): what its K-FAC
    factors must match (S is ``d_out x d_out``, A is ``d_in x d_in``)."""
    from ..layers import weight_matrix

    return {name: tuple(weight_matrix(m).shape) for name, m in layers.items()}
