"""The method registry: catalogue entries (torch-free) and the editor classes they name (loaded lazily).

Every method is one :class:`MethodSpec` — its ``--method`` name, a one-line summary, its options
(a :class:`MethodConfig` dataclass with the paper's defaults, and ``Config.SHARED`` for the method's
own defaults of shared settings such as the learning rate) and where its editor class lives. The CLI
parser (``--method`` choices, ``--<method>-<option>`` flags) and :class:`~crispedit.editing.EditConfig`
validation read only these entries, so a command that fails on its arguments never imports torch; the
editor class (which imports torch) is imported the first time an edit needs it (:func:`editor_class`).

The built-in entries are each method's ``METHOD`` in :mod:`crispedit.methods`, which the first read of the
catalogue imports by name (:data:`BUILTINS`): the methods sit above this module (they subclass the editor
interface built on it), so it finds them the way it finds an editor class — by name, not by an import
statement. The lowest piece of ``editing``: it imports nothing from the package but the base layer, so
:mod:`.config` can check a method name and its options here.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from ..errors import CrispEditError
from ..settings import Settings

__all__ = [
    "MethodConfig",
    "MethodSpec",
    "EDITORS",
    "add_method",
    "method_spec",
    "register_editor",
    "get_editor",
    "editor_class",
    "method_names",
    "SEQ_SUFFIX",
    "SEQUENTIAL_MODES",
    "seq_row",
    "sequential_rows",
]

SEQ_SUFFIX = "-seq"  # ``<method>-seq``: a compare row running ``<method>`` in sequential rounds
SEQUENTIAL_MODES = ("paper", "optional", "none")


@dataclass
class MethodConfig(Settings):
    """Options of one method beyond the shared :class:`~crispedit.editing.EditConfig` (subclass it per
    editor, with the paper's defaults, each option declared with :func:`~crispedit.settings.setting` so its help
    becomes the CLI flag ``--<method>-<option>``). ``SHARED`` holds the method's own defaults for shared
    EditConfig fields that are left unset (e.g. LoRA's learning rate)."""

    SHARED: ClassVar[dict[str, Any]] = {}

    @classmethod
    def from_options(cls, method: str, options: dict | None) -> MethodConfig:
        """Build from a (possibly partial) options dict; unknown keys are a one-line error."""
        options = dict(options or {})
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise CrispEditError(
                f"unknown {method} option(s) {', '.join(unknown)}; "
                f"{method} takes {', '.join(known) if known else 'no options'}"
            )
        try:
            return cls(**options)
        except TypeError as exc:  # a value of the wrong kind that the dataclass itself rejects
            raise CrispEditError(f"{method} options: {exc}") from None


@dataclass(frozen=True)
class MethodSpec:
    """One method as the parser and the config see it: ``name`` (the ``--method`` value), ``summary``
    (one line for ``--help``), ``Config`` (its options dataclass) and ``editor``, the editor class as
    ``"module:Class"`` (imported only by :func:`editor_class`); ``curvature``: the editor needs (and
    holds) capability K-FAC factors (its class's ``needs_curvature`` with ``curvature_kind == "kfac"``; the
    closed forms' input covariance does not count). ``drift_budget``: the method trains in steps the
    ``--max-drift`` budget and the ``--drift-penalty`` act on (the fine-tuning methods, LoRA on its merged
    update; a method without curvature gets the capability K-FAC factors fetched for them, as
    ``--predict-drift`` does), not one closed-form or network pass. ``sequential``: whether
    ``<name>-seq`` (the method in sequential rounds through :mod:`crispedit.sessions.sequential`) is a
    ``compare`` row — ``"paper"`` (the paper's Table 1 has it; part of ``--methods all``), ``"optional"``
    (may be named) or ``"none"`` (refused: the method has no sequential mode of its own)."""

    name: str
    summary: str
    Config: type[MethodConfig]
    editor: str
    curvature: bool = False
    sequential: str = "optional"
    drift_budget: bool = False

    def __post_init__(self) -> None:
        if self.sequential not in SEQUENTIAL_MODES:
            raise ValueError(
                f"MethodSpec {self.name!r}: sequential must be one of {SEQUENTIAL_MODES}, got {self.sequential!r}"
            )

    @property
    def shared(self) -> dict[str, Any]:
        """The method's defaults for shared :class:`EditConfig` fields left unset (``Config.SHARED``)."""
        return dict(self.Config.SHARED)


BUILTINS = "crispedit.methods"  # the package whose modules declare the built-in methods (their ``METHOD``)

_SPECS: dict[str, MethodSpec] = {}  # read through _catalogue(), which adds the built-in methods first
_CLASSES: dict[str, type] = {}  # editor classes imported so far (or registered at run time), by name
_builtins_read = False


def _catalogue() -> dict[str, MethodSpec]:
    """Every catalogue entry by name; the first call imports :data:`BUILTINS`, whose import adds the built-in
    methods (:func:`crispedit.methods.discover`), so they precede any method registered at run time."""
    global _builtins_read
    if not _builtins_read:
        _builtins_read = True  # set first: the discovery itself adds entries through add_method
        try:
            importlib.import_module(BUILTINS)
        except BaseException:
            _builtins_read = False  # a broken method module: the next read tries again (and fails the same way)
            raise
    return _SPECS


def _location(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def add_method(spec: MethodSpec) -> MethodSpec:
    """Add a catalogue entry (no import of its editor); a second, different entry of that name is refused."""
    if spec.name.endswith(SEQ_SUFFIX):
        raise ValueError(f"a method name may not end in {SEQ_SUFFIX!r} (the sequential rows' suffix): {spec.name!r}")
    catalogue = _catalogue()
    if spec.name in catalogue and catalogue[spec.name] != spec:
        raise ValueError(f"a method named {spec.name!r} is already registered")
    catalogue[spec.name] = spec
    return spec


def method_spec(name: str) -> MethodSpec:
    """The catalogue entry of method ``name`` (one-line error naming the choices otherwise)."""
    try:
        return _catalogue()[name]
    except (KeyError, TypeError):
        raise CrispEditError(f"unknown method {name!r}; choose one of {', '.join(method_names())}") from None


def method_names() -> list[str]:
    """Every registered method name, sorted (the CLI's ``--method`` choices)."""
    return sorted(_catalogue())


def seq_row(name: str) -> tuple[str, bool]:
    """A ``compare`` row name -> ``(method, sequential)``: ``"lora-seq"`` -> ``("lora", True)``, ``"lora"`` ->
    ``("lora", False)``. One-line :class:`CrispEditError` for an unknown method (with or without the suffix)
    or a ``-seq`` row of a method whose catalogue entry has no sequential mode."""
    name = str(name)
    if not name.endswith(SEQ_SUFFIX) or name in _catalogue():
        method_spec(name)
        return name, False
    base = name[: -len(SEQ_SUFFIX)]
    if base not in _catalogue():
        raise CrispEditError(
            f"unknown method {name!r}: {base!r} is not a method; sequential rows exist for "
            f"{', '.join(n + SEQ_SUFFIX for n in sequential_rows(every=True))}"
        )
    if _catalogue()[base].sequential == "none":
        raise CrispEditError(
            f"{base} has no sequential mode, so there is no {name} row; sequential rows exist for "
            f"{', '.join(n + SEQ_SUFFIX for n in sequential_rows(every=True))}"
        )
    return base, True


def sequential_rows(every: bool = False) -> list[str]:
    """Methods (sorted) whose ``-seq`` row exists: those the paper's Table 1 has (``every=False``; what
    ``compare --methods all`` adds) or every one with a sequential mode (``every=True``)."""
    ok = ("paper", "optional") if every else ("paper",)
    return [n for n in method_names() if _catalogue()[n].sequential in ok]


def _holds_kfac(cls: type) -> bool:
    """Whether an editor class needs (and holds) capability K-FAC factors."""
    return bool(getattr(cls, "needs_curvature", False)) and getattr(cls, "curvature_kind", "kfac") == "kfac"


def _takes_drift_budget(cls: type) -> bool:
    """Whether an editor class registered at run time takes ``--max-drift`` / ``--drift-penalty``: it holds K-FAC
    factors, or it edits through the base class's ``apply`` (the shared loop, which applies the budget)."""
    return _holds_kfac(cls) or getattr(getattr(cls, "apply", None), "__qualname__", "") == "Editor.apply"


def register_editor(cls: type) -> type:
    """Bind an editor class (a subclass of :class:`~crispedit.editing.editor.Editor`) to its catalogue entry
    ``cls.name``, setting ``cls.summary`` and ``cls.Config`` from it (the entry is their one source; a catalogued
    class must not set them itself): :func:`editor_class` does this when it loads a built-in editor. A class
    without an entry — an editor added at run time, which uses this as a class decorator — gets one from its
    own ``name``, ``summary`` and ``Config``."""
    if _CLASSES.get(cls.name) is cls:
        return cls
    spec = _catalogue().get(cls.name)
    if spec is None:
        add_method(
            MethodSpec(
                cls.name,
                cls.summary,
                cls.Config,
                _location(cls),
                _holds_kfac(cls),
                drift_budget=_takes_drift_budget(cls),
            )
        )
    elif spec.editor != _location(cls):
        raise ValueError(f"a method named {cls.name!r} is already registered (editor {spec.editor})")
    elif spec.curvature != _holds_kfac(cls):
        raise ValueError(
            f"{_location(cls)}.needs_curvature / curvature_kind differ from the catalogue entry of {cls.name!r}"
        )
    else:
        own = [a for a in ("summary", "Config") if a in vars(cls)]
        if own:
            raise ValueError(f"{_location(cls)} sets {', '.join(own)}; the catalogue entry of {cls.name!r} holds them")
        cls.summary, cls.Config = spec.summary, spec.Config
    _CLASSES[cls.name] = cls
    return cls


def editor_class(name: str) -> type:
    """The editor class of method ``name``, importing its module on first use (one-line error naming the
    choices for an unknown name)."""
    spec = method_spec(name)
    if name not in _CLASSES:
        module, _, qualname = spec.editor.partition(":")
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if getattr(cls, "name", None) != name:
            raise ValueError(f"{spec.editor} is named {getattr(cls, 'name', None)!r}, not {name!r} (its METHOD)")
        register_editor(cls)
    return _CLASSES[name]


def get_editor(name: str):
    """A fresh instance of the editor registered as ``name``."""
    return editor_class(name)()


class _Editors(MutableMapping):
    """``name -> editor class`` over the catalogue: iterating lists names without importing anything;
    looking one up imports its editor (:func:`editor_class`); ``del`` removes a method, assignment
    registers a class under its own name."""

    def __getitem__(self, name: str) -> type:
        if name not in _catalogue():
            raise KeyError(name)
        return editor_class(name)

    def __setitem__(self, name: str, cls: type) -> None:
        if getattr(cls, "name", None) != name:
            raise ValueError(f"editor class {cls!r} is named {getattr(cls, 'name', None)!r}, not {name!r}")
        register_editor(cls)

    def __delitem__(self, name: str) -> None:
        del _catalogue()[name]
        _CLASSES.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(method_names())

    def __len__(self) -> int:
        return len(_catalogue())

    def __repr__(self) -> str:
        return f"EDITORS({method_names()})"


EDITORS: MutableMapping = _Editors()
