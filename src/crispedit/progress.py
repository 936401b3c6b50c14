"""One rule for whether progress bars show: ``progress=True/False`` decides; ``None`` (the default
everywhere) shows them only when stderr is a terminal. crispedit's own tqdm bars get the same rule
from ``disable=None``; this helper is for the libraries' bars that crispedit switches on and off."""

from __future__ import annotations

import sys

__all__ = ["show_progress"]


def show_progress(progress: bool | None) -> bool:
    """Whether a progress bar shows: ``progress`` itself when given, else whether stderr is a terminal."""
    return sys.stderr.isatty() if progress is None else bool(progress)
