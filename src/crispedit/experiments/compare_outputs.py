"""The files a compare writes into its directory: ``compare.json`` (the payload, format :data:`COMPARE_FORMAT`),
``compare.md`` (:mod:`~crispedit.experiments.compare_table`), ``compare.png``
(:mod:`~crispedit.experiments.compare_plot`) and the ``-seq`` rows' retention pictures
(:mod:`~crispedit.experiments.retention`); all of them rewritten after every row, and re-rendered from a stored
``compare.json`` without running anything (:func:`render_outputs`).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from ..atomic import atomic_write_bytes, atomic_write_json
from ..errors import CrispEditError
from ..paths import read_text_file
from ..versions import check_written_by
from .compare_plot import plot_compare
from .compare_table import compare_table, pareto_points
from .retention import RETENTION_MAP_PNG, RETENTION_PNG, plot_retention, plot_retention_map

__all__ = ["write_outputs", "read_compare", "render_outputs", "COMPARE_FORMAT", "JSON_FILE", "MD_FILE", "PNG_FILE"]


COMPARE_FORMAT = 1


JSON_FILE, MD_FILE, PNG_FILE = "compare.json", "compare.md", "compare.png"


def write_outputs(out: Path, payload: dict) -> None:
    """Rewrite compare.json (atomic; its ``pareto`` section recomputed, :func:`pareto_points`), compare.md
    (:func:`compare_table`), compare.png (:func:`plot_compare`) and, when ``-seq`` rows carry round-1 retention,
    retention.png (:func:`~crispedit.experiments.retention.plot_retention`) and the retention map,
    retention_map.png (:func:`~crispedit.experiments.retention.plot_retention_map`); the pictures are derived,
    so a missing matplotlib is not fatal."""
    payload["pareto"] = pareto_points(payload)
    atomic_write_json(out / JSON_FILE, payload)
    atomic_write_bytes(out / MD_FILE, compare_table(payload).encode())
    with contextlib.suppress(ImportError):
        plot_compare(payload, out / PNG_FILE)
        plot_retention(payload, out / RETENTION_PNG)
        plot_retention_map(payload, out / RETENTION_MAP_PNG)


def read_compare(path: Path, then: str) -> dict:
    """The payload of the stored compare file ``path`` (``DIR/compare.json``), checked: JSON with ``settings``,
    ``results`` and ``methods`` of the right kinds, written by this crispedit version in :data:`COMPARE_FORMAT`
    (:func:`~crispedit.versions.check_written_by`); anything else a one-line
    :class:`~crispedit.errors.CrispEditError` ending in ``then`` (what to do instead)."""
    try:
        old = json.loads(read_text_file(path, "compare file"))
    except json.JSONDecodeError:
        raise CrispEditError(f"{path} is corrupt; {then}") from None
    if (
        not isinstance(old, dict)
        or not isinstance(old.get("settings", {}), dict)
        or not isinstance(old.get("results", {}), dict)
        or not isinstance(old.get("methods", []), list)
    ):
        raise CrispEditError(f"{path} is not a crispedit compare file; {then}")
    return check_written_by(old, path, then, format=COMPARE_FORMAT)


def render_outputs(out: str | Path) -> dict:
    """Re-render ``DIR/compare.md``, ``DIR/compare.png`` and ``compare.json``'s ``pareto`` section from a stored
    ``DIR/compare.json`` (:func:`write_outputs`) without running or loading anything else; the measured
    results are left as they are. Returns the payload; a missing file, or one another crispedit version wrote or of
    another ``format``, or not a compare file (:func:`read_compare`), is a :class:`~crispedit.errors.CrispEditError`."""
    out = Path(out)
    path = out / JSON_FILE
    if not path.is_file():
        raise CrispEditError(f"{path} does not exist: nothing to render")
    payload = read_compare(path, "rerun the compare")
    write_outputs(out, payload)
    return payload
