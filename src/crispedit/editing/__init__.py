"""Editing: the editors (``methods/``, one module per method), the shared projected loop, edit contexts,
batch :func:`edit` and sequential sessions."""

from . import methods  # noqa: F401  (registers every method before any config is validated)
from .api import EditResult, capability_factors, curvature_spec, edit, restore
from .config import DEFAULT_LR, EditConfig, ProjectionTarget
from .loop import TrainHistory, edit_loss, projected_finetune
from .methods import EditContext, EditOutcome, Editor
from .registry import EDITORS, MethodConfig, editor_class, get_editor, method_names, register_editor

__all__ = ["EditConfig", "ProjectionTarget", "DEFAULT_LR", "EditResult", "edit", "restore", "capability_factors",
           "curvature_spec", "EDITORS", "Editor", "EditContext", "EditOutcome", "MethodConfig", "editor_class",
           "get_editor", "method_names", "register_editor", "projected_finetune", "edit_loss", "TrainHistory"]
