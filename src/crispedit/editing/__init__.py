"""Editing: the editors (``methods/``, one module per method), the shared projected loop, edit contexts,
batch :func:`edit` and sequential sessions.

Importing this package is cheap: it loads the torch-free method catalogue (so every method's name and
options are known) and nothing else; each name below is imported from its module on first use.
"""

from . import catalogue  # noqa: F401  (declares the built-in methods; torch-free)
from .._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(["EditResult", "capability_factors", "curvature_spec", "edit", "restore"], ".api"),
    **dict.fromkeys(["DEFAULT_LR", "EditConfig", "ProjectionTarget", "SeqConfig"], ".config"),
    **dict.fromkeys(["TrainHistory", "edit_loss", "projected_finetune"], ".loop"),
    **dict.fromkeys(["EditContext", "EditOutcome", "Editor"], ".methods"),
    **dict.fromkeys(["EDITORS", "MethodConfig", "MethodSpec", "editor_class", "get_editor", "method_names",
                     "method_spec", "register_editor"], ".registry"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["EditConfig", "SeqConfig", "ProjectionTarget", "DEFAULT_LR", "EditResult", "edit", "restore",
           "capability_factors", "curvature_spec", "EDITORS", "Editor", "EditContext", "EditOutcome", "MethodConfig",
           "MethodSpec", "editor_class", "get_editor", "method_names", "method_spec", "register_editor",
           "projected_finetune", "edit_loss", "TrainHistory"]
