"""The editing methods, one module each (the folder list reads as the paper's method list), beside the
editor interface they share (``base.py``: :class:`Editor`, whose default ``apply`` is the projected loop
of ``editing/loop.py``; ``single_pass.py``: the skeleton of the editors that write their change in one pass).
Importing this package registers every method."""

from . import adam_nscl, alphaedit, crispedit, ft, locbf_ft, lora, memit, mend, ultraedit  # noqa: F401  (registration)
from .base import EditContext, EditOutcome, Editor, identity_projectors

__all__ = ["Editor", "EditContext", "EditOutcome", "identity_projectors"]
