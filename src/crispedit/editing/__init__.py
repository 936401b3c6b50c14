"""Editing: the machinery every method shares — the method registry and :class:`EditConfig` (its
phases' settings: :mod:`.phases`), the editor
interface (:mod:`.editor`) and the single-pass skeleton (:mod:`.single_pass`), the projected loop
(:mod:`.loop`) with its fast path, contexts, optimiser and step timer, the key-value and gradient-row
collectors of the closed-form and transform methods — and batch :func:`edit`. The methods themselves are
:mod:`crispedit.methods`; sequential sessions are :mod:`crispedit.sessions`.

Importing this package is cheap: each name below is imported from its module on first use, and the method
catalogue is read (torch-free) the first time a method is looked up.
"""

from .._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(
        ["EditResult", "capability_factors", "curvature_spec", "edit", "restore", "shard_for_edit"], ".api"
    ),
    **dict.fromkeys(["DEFAULT_LR", "EditConfig", "ProjectionTarget", "SeqConfig"], ".config"),
    **dict.fromkeys(
        ["MethodSelection", "CurvatureConfig", "ProjectionConfig", "TrainingConfig", "SequencesConfig", "DriftConfig"],
        ".phases",
    ),
    **dict.fromkeys(["EditContext", "EditOutcome", "Editor"], ".editor"),
    **dict.fromkeys(["edit_loss", "projected_finetune"], ".loop"),
    **dict.fromkeys(["TrainHistory"], ".history"),
    **dict.fromkeys(
        [
            "EDITORS",
            "MethodConfig",
            "MethodSpec",
            "editor_class",
            "get_editor",
            "method_names",
            "method_spec",
            "register_editor",
        ],
        ".registry",
    ),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "EditConfig",
    "SeqConfig",
    "ProjectionTarget",
    "DEFAULT_LR",
    "MethodSelection",
    "CurvatureConfig",
    "ProjectionConfig",
    "TrainingConfig",
    "SequencesConfig",
    "DriftConfig",
    "EditResult",
    "edit",
    "restore",
    "shard_for_edit",
    "capability_factors",
    "curvature_spec",
    "EDITORS",
    "Editor",
    "EditContext",
    "EditOutcome",
    "MethodConfig",
    "MethodSpec",
    "editor_class",
    "get_editor",
    "method_names",
    "method_spec",
    "register_editor",
    "projected_finetune",
    "edit_loss",
    "TrainHistory",
]
