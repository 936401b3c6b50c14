"""Merging compares: the rows of several compare directories run under the same settings — the same model
weights, edits and evaluation, e.g. one compare's methods split over two machines or processes to finish sooner —
into one ``compare.json`` with its table and pictures, as if one compare had run them all.

Each source is checked as a resume checks a stored compare
(:func:`~crispedit.experiments.compare_outputs.read_compare`).
Their ``settings`` must be equal — but for where the model and the edits were read from, when the weight
fingerprint and the requests' digest say they are the same (:data:`WHERE`) — and their base rows agree (the
unedited model measured the same, to a relative :data:`BASE_RTOL` for numerics that differ across machines); a
method row in two sources is refused, never chosen. The merged payload keeps the first source's settings and base
row, takes every other row as its source stored it, lists the methods in source order and records where each row
came from (``merged_from``). A later ``crispedit compare`` on the merged directory resumes it like any other.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from pathlib import Path

from ..errors import CrispEditError
from ..versions import stamped
from .compare_outputs import JSON_FILE, read_compare, write_outputs

__all__ = ["BASE_RTOL", "merge_compares"]

BASE_RTOL = 1e-3  # base rows' numbers may differ this much (relative) across machines and still be one base
# settings that name where the model and the edits were found: another machine's paths, the same content when the
# weight fingerprint and the requests' digest agree
WHERE = {"model": "fingerprint", "edits": "requests_digest"}


def _differing(a: dict, b: dict) -> list[str]:
    """The settings two compares differ in, a path in :data:`WHERE` only where its content key is missing."""
    keys = sorted(set(a) | set(b))
    return [
        k
        for k in keys
        if a.get(k) != b.get(k) and not (k in WHERE and a.get(WHERE[k]) is not None and b.get(WHERE[k]) is not None)
    ]


def _numbers(tree, prefix: str = "") -> dict[str, float]:
    """Every number in a JSON tree by its dotted path (booleans are not numbers)."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _numbers(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in _numbers(sub, f"{prefix}{i}.").items()}
    if isinstance(tree, (int, float)) and not isinstance(tree, bool):
        return {prefix.rstrip("."): float(tree)}
    return {}


def _base_difference(a: dict, b: dict) -> str | None:
    """The first number of two base rows' ``summary`` and ``capabilities`` that differs by more than
    :data:`BASE_RTOL`, as ``"summary.ppl 39.1 vs 40.2"``; ``None`` when they agree."""
    for part in ("summary", "capabilities"):
        x, y = _numbers(a.get(part) or {}), _numbers(b.get(part) or {})
        for key in sorted(set(x) | set(y)):
            if key not in x or key not in y:
                return f"{part}.{key} in one only"
            if not math.isclose(x[key], y[key], rel_tol=BASE_RTOL, abs_tol=1e-9):
                return f"{part}.{key} {x[key]:g} vs {y[key]:g}"
    return None


def merge_compares(sources: Sequence[str | Path], out: str | Path) -> dict:
    """Merge the compares in the directories ``sources`` (at least two, each holding ``compare.json``) into
    ``out`` (``compare.json``, ``compare.md``, ``compare.png`` and the retention pictures, written atomically:
    :func:`~crispedit.experiments.compare_outputs.write_outputs`) and return the merged payload. ``out`` may be one of
    the sources; a ``compare.json`` already in another ``out`` is refused rather than overwritten. Sources of other
    settings, with disagreeing base rows or sharing a method row, are one-line
    :class:`~crispedit.errors.CrispEditError`\\ s and nothing is written."""
    dirs = [Path(s) for s in sources]
    out = Path(out)
    if len(dirs) < 2:
        raise CrispEditError("merging takes at least two compare directories")
    if len({d.resolve() for d in dirs}) < len(dirs):
        raise CrispEditError("a compare directory is named twice")
    payloads = []
    for d in dirs:
        if not (d / JSON_FILE).is_file():
            raise CrispEditError(f"{d / JSON_FILE} does not exist: {d} is not a compare directory")
        payloads.append(read_compare(d / JSON_FILE, "rerun that compare with this crispedit"))
    if (out / JSON_FILE).is_file() and out.resolve() not in {d.resolve() for d in dirs}:
        raise CrispEditError(f"{out / JSON_FILE} exists and is not one of the merged compares; choose another --out")
    first = payloads[0]
    merged = copy.deepcopy(first)
    merged["methods"], merged["results"], origin = [], {}, []
    for d, p in zip(dirs, payloads):
        differ = _differing(first.get("settings", {}), p.get("settings", {}))
        if differ:
            raise CrispEditError(
                f"{d} was run with other settings than {dirs[0]} ({', '.join(differ)}); only compares of the same "
                "model, edits and evaluation merge"
            )
        results = p.get("results", {})
        base = results.get("base")
        if base is None:
            raise CrispEditError(f"{d / JSON_FILE} has no base row: that compare never started")
        if "base" in merged["results"]:
            diff = _base_difference(merged["results"]["base"], base)
            if diff is not None:
                raise CrispEditError(f"the base rows of {dirs[0]} and {d} differ ({diff}): they measured another model")
        else:
            merged["results"]["base"] = base
        rows = [m for m in p.get("methods", []) if m in results and m != "base"]
        for m in rows:
            if m in merged["results"]:
                holder = next(o["dir"] for o in origin if m in o["methods"])
                raise CrispEditError(f"{d} and {holder} both hold a {m} row; merge only one of them")
            merged["results"][m] = results[m]
            merged["methods"].append(m)
        origin.append({"dir": str(d), "methods": rows})
    merged["merged_from"] = origin
    merged = stamped(merged)
    out.mkdir(parents=True, exist_ok=True)
    write_outputs(out, merged)
    return merged
