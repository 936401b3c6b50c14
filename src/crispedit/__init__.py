"""crispedit: non-destructive knowledge editing of LLMs with low-curvature projected fine-tuning.

The names below are imported on first use (``from crispedit import edit`` works as usual), so that
``import crispedit`` — and the command line — does not import torch or transformers until needed."""

__version__ = "0.1.0"

from ._lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "EditRequest": ".data",
        "load_edits": ".data",
        "EditConfig": ".editing",
        "edit": ".editing",
        "restore": ".editing",
        "CrispEditError": ".errors",
        "load_model": ".models",
        "resolve_layers": ".layers",
    },
)

__all__ = [
    "__version__",
    "EditRequest",
    "load_edits",
    "EditConfig",
    "edit",
    "restore",
    "CrispEditError",
    "load_model",
    "resolve_layers",
]
