"""The editor registry and the base of every method's config dataclass.

The lowest piece of ``editing``: it imports nothing from the package, so :mod:`.config` can check a
method name and its options here while the methods (``editing/methods/``) register themselves on
import (``crispedit.editing`` imports them all).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from ..errors import CrispEditError

__all__ = ["MethodConfig", "EDITORS", "register_editor", "get_editor", "editor_class", "method_names"]


@dataclass
class MethodConfig:
    """Options of one method beyond the shared :class:`~crispedit.editing.EditConfig` (subclass it per
    editor, with the paper's defaults). ``SHARED`` holds the method's own defaults for shared
    EditConfig fields that are left unset (e.g. LoRA's learning rate); ``HELP`` one line per field
    for the CLI flags ``--<method>-<field>``."""

    SHARED: ClassVar[dict[str, Any]] = {}
    HELP: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "MethodConfig":
        """Check every field (one-line :class:`CrispEditError`); return ``self``."""
        return self

    def to_json(self) -> dict:
        """The options as a JSON-ready dict (stored in ``EditConfig.options``)."""
        return asdict(self)

    @classmethod
    def from_options(cls, method: str, options: dict | None) -> "MethodConfig":
        """Build from a (possibly partial) options dict; unknown keys are a one-line error."""
        options = dict(options or {})
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise CrispEditError(f"unknown {method} option(s) {', '.join(unknown)}; "
                                 f"{method} takes {', '.join(known) if known else 'no options'}")
        try:
            return cls(**options)
        except TypeError as exc:  # a value of the wrong kind that the dataclass itself rejects
            raise CrispEditError(f"{method} options: {exc}") from None


EDITORS: dict[str, type] = {}


def register_editor(cls: type) -> type:
    """Class decorator: register an editor class (a subclass of ``methods.base.Editor``) under its ``name``."""
    if cls.name in EDITORS and EDITORS[cls.name] is not cls:
        raise ValueError(f"an editor named {cls.name!r} is already registered")
    EDITORS[cls.name] = cls
    return cls


def editor_class(name: str) -> type:
    """The editor class registered as ``name`` (one-line error naming the choices otherwise)."""
    try:
        return EDITORS[name]
    except (KeyError, TypeError):
        raise CrispEditError(f"unknown method {name!r}; choose one of {', '.join(method_names())}") from None


def get_editor(name: str):
    """A fresh instance of the editor registered as ``name``."""
    return editor_class(name)()


def method_names() -> list[str]:
    """Every registered method name, sorted (the CLI's ``--method`` choices)."""
    return sorted(EDITORS)
