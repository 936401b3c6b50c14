"""One rule for whether progress bars show: ``progress=True/False`` decides; ``None`` (the default
everywhere) shows them only when stderr is a terminal. crispedit's own tqdm bars get the same rule
from ``disable=None``; this helper is for the libraries' bars that crispedit switches on and off."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import TextIO

__all__ = ["show_progress", "progress_lines", "log_lines"]


def show_progress(progress: bool | None) -> bool:
    """Whether a progress bar shows: ``progress`` itself when given, else whether stderr is a terminal."""
    return sys.stderr.isatty() if progress is None else bool(progress)


@contextlib.contextmanager
def log_lines(level: int | str, stream: TextIO, fmt: str) -> Iterator[None]:
    """Within: the ``crispedit`` loggers' messages of ``level`` and above are printed to ``stream``, one line each
    in the :class:`logging.Formatter` format ``fmt``; the handler and the logger's level are removed / restored
    afterwards (nested uses each print at their own level)."""
    logger = logging.getLogger("crispedit")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(fmt, "%Y-%m-%d %H:%M:%S"))
    handler.setLevel(level)
    before = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(handler.level, logger.getEffectiveLevel()))
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)


@contextlib.contextmanager
def progress_lines(progress: bool | None, stream: TextIO | None = None) -> Iterator[bool]:
    """Within: where bars do not show (:func:`show_progress` false), crispedit's INFO log lines — curvature
    collected or cached, every few epochs of an edit — are printed to ``stream`` (default stdout), one line
    each, instead of the bars; yields whether lines are on. The handler is removed afterwards."""
    if show_progress(progress):
        yield False
        return
    with log_lines(logging.INFO, stream or sys.stdout, "  %(message)s"):
        yield True
