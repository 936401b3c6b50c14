"""Editing: one projected fine-tuning loop; editors differ by trained parameters and projector."""

from .api import EditResult, capability_factors, curvature_spec, edit, restore
from .config import EditConfig, ProjectionTarget
from .editors import EDITORS, Editor, get_editor, register_editor
from .loop import TrainHistory, edit_loss, projected_finetune

__all__ = ["EditConfig", "ProjectionTarget", "EditResult", "edit", "restore", "capability_factors",
           "curvature_spec", "EDITORS", "Editor", "get_editor", "register_editor", "projected_finetune",
           "edit_loss", "TrainHistory"]
