"""Validated settings dataclasses: one base for every config, and help text kept on the fields.

A config is a dataclass that derives from :class:`Settings`: it is checked on construction (its
:meth:`~Settings.validate`), written as JSON by :meth:`~Settings.to_json` and read back by
:meth:`~Settings.from_dict`, which refuses unknown keys in one line. Each field that a user sets is declared with
:func:`setting`, which keeps its help text (and, for the command line, its flag name, metavar and choices) in the
field's metadata, so a parser is generated from the dataclass (:func:`crispedit.cli.flags.add_settings_args`)
instead of written flag by flag, and the help lives beside the default it describes — the shape of peft's
configs. Torch-free, like every config: a command checks its arguments before torch is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from typing import Any, ClassVar

from .errors import CrispEditError

__all__ = ["Settings", "setting", "SettingHelp"]

# help text: a string (``{default}`` is replaced by the field's default) or a function of the settings class that
# returns one, for help that reads a catalogue (the methods' defaults, the training contexts) when a parser is built
SettingHelp = str | Callable[[type], str]


def setting(
    default: Any = MISSING,
    *,
    help: SettingHelp,
    default_factory: Callable[[], Any] | Any = MISSING,
    flag: str | None = None,
    metavar: str | None = None,
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None,
    cli: bool = True,
) -> Any:
    """A dataclass field with its user-facing description in ``metadata``: ``help`` (see :data:`SettingHelp`),
    ``flag`` (the command-line flag; default ``--<name with dashes>``), ``metavar``, ``choices`` (values or a
    function returning them) and ``cli`` (whether the generated parser offers it at all)."""
    meta = {"help": help, "flag": flag, "metavar": metavar, "choices": choices, "cli": cli}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Settings:
    """Base of the validated configs: :meth:`validate` runs on construction and after :meth:`from_dict`;
    ``KIND`` names the config in messages (``unknown edit config keys: ...``)."""

    KIND: ClassVar[str] = "config"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> Settings:
        """Check every field (a one-line :class:`CrispEditError` naming the bad one), normalise types, return
        ``self``; subclasses extend it."""
        return self

    def to_json(self) -> dict:
        """The settings as a JSON-ready dict, every field."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Settings:
        """Rebuild from :meth:`to_json` output; unknown keys are a one-line error, absent ones take their
        defaults."""
        if not isinstance(d, dict):
            raise CrispEditError(f"{cls.KIND} must be a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise CrispEditError(f"unknown {cls.KIND} keys: {', '.join(unknown)}")
        try:
            return cls(**d)
        except TypeError as exc:  # a value of a kind the dataclass itself cannot take
            raise CrispEditError(f"{cls.KIND}: {exc}") from None

    @classmethod
    def metadata_of(cls, name: str) -> dict:
        """What :func:`setting` recorded for field ``name``: its own declaration's, or, where a subclass redeclared
        the field with only a new default, the nearest base class's; ``{}`` for a field declared without help."""
        for klass in cls.__mro__:
            f = getattr(klass, "__dataclass_fields__", {}).get(name)
            if f is not None and "help" in f.metadata:
                return dict(f.metadata)
        return {}

    @classmethod
    def described(cls) -> Iterator[Field]:
        """The fields that carry help (:meth:`metadata_of`), in declaration order."""
        return (f for f in fields(cls) if cls.metadata_of(f.name))

    @classmethod
    def help_of(cls, name: str) -> str:
        """The help text of field ``name``, its ``{default}`` filled in with this class's default; ``""`` for a
        field without one."""
        text = cls.metadata_of(name).get("help", "")
        text = text(cls) if callable(text) else text
        default = cls.__dataclass_fields__[name].default if name in cls.__dataclass_fields__ else MISSING
        default = None if default is MISSING else default
        return text.replace("{default}", f"{default:g}" if isinstance(default, float) else str(default))
