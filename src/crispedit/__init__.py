"""crispedit: non-destructive knowledge editing of LLMs with low-curvature projected fine-tuning."""

__version__ = "0.1.0"

from .data import EditRequest, load_edits  # noqa: E402
from .editing import EditConfig, edit, restore  # noqa: E402
from .errors import CrispEditError  # noqa: E402
from .models import load_model, resolve_layers  # noqa: E402

__all__ = ["__version__", "EditRequest", "load_edits", "EditConfig", "edit", "restore", "CrispEditError",
           "load_model", "resolve_layers"]
