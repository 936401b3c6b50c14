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

__all__ = ["write_outputs", "render_outputs", "COMPARE_FORMAT", "JSON_FILE", "MD_FILE", "PNG_FILE"]


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


def render_outputs(out: str | Path) -> dict:
    """Re-render ``DIR/compare.md``, ``DIR/compare.png`` and ``compare.json``'s ``pareto`` section from a stored
    ``DIR/compare.json`` (:func:`write_outputs`) without running or loading anything else; the measured
    results are left as they are. Returns the payload; a missing file, or one another crispedit version wrote or of
    another ``format`` (:func:`~crispedit.versions.check_written_by`), is a
    :class:`~crispedit.errors.CrispEditError`."""
    out = Path(out)
    path = out / JSON_FILE
    if not path.is_file():
        raise CrispEditError(f"{path} does not exist: nothing to render")
    payload = json.loads(read_text_file(path, what="compare results"))
    check_written_by(payload, path, "rerun the compare", format=COMPARE_FORMAT)
    write_outputs(out, payload)
    return payload
