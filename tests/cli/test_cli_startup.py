"""Start-up cost of a failing command: ``--help`` of every sub-command, and commands that fail on
their arguments, answer without importing torch or transformers (torch alone costs seconds to import).

Each case runs ``crispedit.cli.main`` in a fresh interpreter and reports which heavy modules ended up in
``sys.modules``; a failing case must still give today's one ``crispedit: error:`` line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import crispedit
from crispedit.cli import build_parser

HEAVY = ("torch", "transformers")
SRC = str(Path(crispedit.__file__).resolve().parents[1])
PROBE = """
import json, sys
{preimport}
from crispedit.cli import main
try:
    rc = main(json.loads(sys.argv[1]))
except SystemExit as exc:  # main returns; anything else is a bug the assertion below shows
    rc = exc.code
print(json.dumps({{"rc": rc, "heavy": sorted(m for m in {heavy!r} if m in sys.modules)}}))
"""


def run_cli(argv: list, cwd: Path, preimport: str = "") -> tuple[int, list[str], str, str]:
    """Run ``main(argv)`` in a new interpreter in ``cwd``: ``(exit code, heavy modules imported, stdout before
    the report line, stderr)``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(preimport=preimport, heavy=HEAVY), json.dumps([str(a) for a in argv])],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    *out, report = proc.stdout.rstrip("\n").split("\n")
    rep = json.loads(report)
    return rep["rc"], rep["heavy"], "\n".join(out), proc.stderr


def subcommands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of ``parser`` (``()``, ``("edit",)``, ``("session", "init")``, ...)."""
    out = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += subcommands(sub, prefix + (name,))
    return out


COMMANDS = subcommands(build_parser())


def test_every_command_is_covered():
    assert {
        ("edit",),
        ("eval",),
        ("report",),
        ("demo",),
        ("compare",),
        ("cache", "build"),
        ("cache", "info"),
        ("cache", "list"),
        ("session", "init"),
        ("session", "add"),
        ("session", "status"),
        ("session", "export"),
        ("session", "plot"),
        ("study", "mnist"),
        ("delta", "info"),
        ("delta", "apply"),
        ("delta", "revert"),
        ("delta", "export-lora"),
        ("export", "gguf"),
    } <= set(COMMANDS)


def _parser_of(command: tuple[str, ...]) -> argparse.ArgumentParser:
    """The parser of one command path of :func:`build_parser`."""
    parser = build_parser()
    for name in command:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "crispedit")
def test_every_flag_and_argument_says_what_it_is(command):
    """``--help`` explains every option and positional argument of every command: none is listed bare."""
    bare = [
        a.option_strings[0] if a.option_strings else a.dest
        for a in _parser_of(command)._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help
    ]
    assert bare == [], f"{' '.join(command)}: no help for {bare}"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "crispedit")
def test_help_imports_neither_torch_nor_transformers(command, tmp_path):
    rc, heavy, out, err = run_cli([*command, "--help"], tmp_path)
    assert rc == 0, err
    assert out.startswith(f"usage: crispedit {' '.join(command)}".rstrip()), out[:200]
    assert heavy == [], f"crispedit {' '.join(command)} --help imported {heavy}"


def _edits(t: Path) -> Path:
    p = t / "edits.json"
    p.write_text(json.dumps([{"src": "Who founded club 1?", "alt": "Founder A"}]))
    return p


def _file(t: Path, name: str, text: str = "x") -> Path:
    p = t / name
    p.write_text(text)
    return p


def _session(t: Path) -> Path:
    """A directory with a session.json that is not an object (a damaged session)."""
    d = t / "sess"
    d.mkdir()
    (d / "session.json").write_text("[1, 2]")
    return d


# (id, builder(tmp) -> argv, text of the one error line); the model never loads, so "smollm2" is just a name
FAILING = [
    (
        "edit-gamma",
        lambda t: ["edit", "--edits", "x.json", "--out", t / "o", "--gamma", 2],
        "gamma must lie strictly between 0 and 1, got 2.0",
    ),
    ("edit-missing-edits", lambda t: ["edit", "--edits", t / "none.json", "--out", t / "o"], "edit file not found"),
    (
        "edit-malformed-json",
        lambda t: ["edit", "--edits", _file(t, "bad.json", '[{"src": "a"'), "--out", t / "o"],
        "malformed JSON",
    ),
    (
        "edit-unknown-method",
        lambda t: ["edit", "--edits", _edits(t), "--out", t / "o", "--method", "rome"],
        "argument --method: invalid choice: 'rome'",
    ),
    (
        "edit-method-option",
        lambda t: ["edit", "--edits", _edits(t), "--out", t / "o", "--method", "lora", "--lora-r", 0],
        "lora rank r must be at least 1",
    ),
    (
        "edit-other-method-option",
        lambda t: ["edit", "--edits", _edits(t), "--out", t / "o", "--locbf-ft-layer", "first"],
        "--locbf-ft-layer applies to method locbf-ft",
    ),
    (
        "edit-contexts",
        lambda t: ["edit", "--edits", _edits(t), "--out", t / "o", "--contexts", "bare,nope"],
        "unknown edit context 'nope'",
    ),
    ("edit-lr", lambda t: ["edit", "--edits", _edits(t), "--out", t / "o", "--lr", "inf"], "must be a finite number"),
    (
        "edit-out-is-file",
        lambda t: ["edit", "--edits", _edits(t), "--out", _file(t, "o")],
        "is a file, not a directory",
    ),
    (
        "edit-kl-text",
        lambda t: ["edit", "--edits", _edits(t), "--out", t / "o", "--kl-text", t / "none.txt"],
        "text file not found",
    ),
    (
        "edit-missing-cache",
        lambda t: ["edit", "--edits", _edits(t), "--out", t / "o", "--cache", t / "c.safetensors"],
        "curvature cache file not found",
    ),
    (
        "edit-max-drift",
        lambda t: ["edit", "--edits", _edits(t), "--out", t / "o", "--max-drift", 0],
        "max drift (--max-drift) must be",
    ),
    (
        "edit-max-drift-memit",
        lambda t: ["edit", "--edits", _edits(t), "--out", t / "o", "--method", "memit", "--max-drift", 0.1],
        "--max-drift / --drift-penalty act on the training steps of a fine-tuning method (adam-nscl, crispedit, ft, "
        "locbf-ft, lora); memit writes its change in one pass without them",
    ),
    (
        "edit-drift-penalty-mend",
        lambda t: ["edit", "--edits", _edits(t), "--out", t / "o", "--method", "mend", "--drift-penalty", 1],
        "mend writes its change in one pass without them",
    ),
    (
        "edit-drift-penalty-negative",
        lambda t: ["edit", "--edits", _edits(t), "--out", t / "o", "--drift-penalty", -1],
        "drift penalty (--drift-penalty) must be",
    ),
    ("edit-no-args", lambda t: ["edit"], "the following arguments are required: --edits, --out"),
    ("unknown-command", lambda t: ["edits"], "invalid choice: 'edits'"),
    (
        "eval-task",
        lambda t: ["eval", "--out", t / "r.json", "--capabilities", "arc_easy"],
        "unknown capability task 'arc_easy'",
    ),
    (
        "eval-missing-edits",
        lambda t: ["eval", "--out", t / "r.json", "--edits", t / "none.json"],
        "edit file not found",
    ),
    (
        "eval-template",
        lambda t: ["eval", "--out", t / "r.json", "--edits", _edits(t), "--context-template", "no slot"],
        "{question}",
    ),
    ("report-missing-run", lambda t: ["report", t / "none.json"], "not found"),
    ("cache-build-n-cap", lambda t: ["cache", "build", "--n-cap", 0], "n-cap must be a positive integer"),
    ("cache-info-missing", lambda t: ["cache", "info", t / "none.safetensors"], "curvature cache file not found"),
    (
        "cache-build-cache-dir-is-file",
        lambda t: ["cache", "build", "--cache-dir", _file(t, "c")],
        "is a file, not a directory",
    ),
    (
        "cache-list-cache-dir-is-file",
        lambda t: ["cache", "list", "--cache-dir", _file(t, "c")],
        "is a file, not a directory",
    ),
    (
        "mend-train-steps-0",
        lambda t: ["mend", "train", "--edits", _edits(t), "--steps", 0],
        "mend steps must be between 1",
    ),
    (
        "mend-train-max-minutes-0",
        lambda t: ["mend", "train", "--edits", _edits(t), "--max-minutes", 0],
        "--max-minutes must be positive",
    ),
    ("demo-gamma", lambda t: ["demo", "--gamma", 2], "gamma must lie strictly between 0 and 1"),
    ("playground-port", lambda t: ["playground", "--port", 70000], "--port must be between 0 and 65535"),
    (
        "playground-missing-cache",
        lambda t: ["playground", "--cache", t / "c.safetensors"],
        "curvature cache file not found",
    ),
    (
        "session-init-mix",
        lambda t: ["session", "init", "--out", t / "s", "--mix", "nan"],
        "mix must be a finite number",
    ),
    (
        "session-init-max-drift",
        lambda t: ["session", "init", "--out", t / "s", "--method", "alphaedit", "--max-drift", 1],
        "alphaedit writes its change in one pass without them",
    ),
    (
        "session-add-missing",
        lambda t: ["session", "add", t / "none", "--edits", _edits(t)],
        "session directory not found",
    ),
    ("session-add-edits", lambda t: ["session", "add", _session(t), "--edits", _edits(t)], "is malformed"),
    ("session-status-missing", lambda t: ["session", "status", t / "none"], "session directory not found"),
    (
        "session-export-missing",
        lambda t: ["session", "export", t / "none", "--out", t / "e"],
        "session directory not found",
    ),
    (
        "session-plot-missing",
        lambda t: ["session", "plot", t / "none", "--out", t / "p.png"],
        "session directory not found",
    ),
    (
        "compare-method",
        lambda t: ["compare", "--edits", _edits(t), "--n-edits", 1, "--methods", "ft,rome", "--out", t / "c"],
        "unknown method 'rome'",
    ),
    (
        "compare-seq-method",
        lambda t: ["compare", "--edits", _edits(t), "--n-edits", 1, "--methods", "ft,ultraedit-seq", "--out", t / "c"],
        "ultraedit has no sequential mode",
    ),
    (
        "compare-seq-chunk",
        lambda t: [
            "compare",
            "--edits",
            _edits(t),
            "--n-edits",
            1,
            "--methods",
            "ft-seq",
            "--seq-chunk",
            0,
            "--out",
            t / "c",
        ],
        "--seq-chunk must be a positive integer",
    ),
    (
        "compare-missing-edits",
        lambda t: ["compare", "--edits", t / "none.json", "--n-edits", 1, "--methods", "ft", "--out", t / "c"],
        "edit file not found",
    ),
    ("delta-info-missing", lambda t: ["delta", "info", t / "none.safetensors"], "delta file not found"),
    (
        "delta-info-not-safetensors",
        lambda t: ["delta", "info", _file(t, "d.safetensors", "not a header")],
        "is not a safetensors file",
    ),
    (
        "delta-apply-out-is-file",
        lambda t: ["delta", "apply", _file(t, "d.safetensors", "x" * 16), "--model", "smollm2", "--out", _file(t, "o")],
        "is not a safetensors file",
    ),
    (
        "delta-export-rank",
        lambda t: ["delta", "export-lora", t / "d.safetensors", "--model", "smollm2", "--rank", 0, "--out", t / "l"],
        "--rank must be a positive integer",
    ),
    (
        "export-gguf-missing-dir",
        lambda t: ["export", "gguf", t / "none", "--out", t / "x.gguf"],
        "model directory not found",
    ),
    (
        "export-gguf-non-llama",
        lambda t: ["export", "gguf", _file(t, "config.json", '{"model_type": "gpt2"}').parent, "--out", t / "x.gguf"],
        "is a gpt2 model",
    ),
    (
        "export-gguf-out-is-dir",
        lambda t: ["export", "gguf", _file(t, "config.json", '{"model_type": "llama"}').parent, "--out", t],
        "is a directory; give a file name",
    ),
    (
        "export-gguf-type",
        lambda t: ["export", "gguf", t, "--out", t / "x.gguf", "--type", "q4_k"],
        "invalid choice: 'q4_k'",
    ),
    ("study-k", lambda t: ["study", "mnist", "--k-values", "inf", "--out", t / "s"], "k values"),
    (
        "study-out-is-file",
        lambda t: ["study", "mnist", "--quick", "--out", _file(t, "s")],
        "is a file, not a directory",
    ),
]


@pytest.mark.parametrize("case,build,msg", FAILING, ids=[c[0] for c in FAILING])
def test_failing_command_imports_neither_torch_nor_transformers(case, build, msg, tmp_path):
    rc, heavy, out, err = run_cli(build(tmp_path), tmp_path)
    lines = [ln for ln in err.splitlines() if ln.startswith("crispedit: error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert msg in lines[0], lines[0]
    assert heavy == [], f"{case}: imported {heavy} before failing with {lines[0]!r}"


def test_probe_sees_an_import_of_torch(tmp_path):
    """The probe itself: a run that does import torch is reported as such (so the checks above can fail)."""
    rc, heavy, _, err = run_cli(["edit", "--gamma", 2], tmp_path, preimport="import torch")
    assert rc == 2 and heavy == ["torch"], (heavy, err)


def test_catalogue_entries_match_their_editor_classes():
    """Each catalogue entry names an editor class that registers under that name and takes its summary
    and options from the entry (one source); an unknown method is one line naming the choices."""
    from crispedit.editing.registry import editor_class, method_names, method_spec
    from crispedit.errors import CrispEditError
    from crispedit.methods import BUILTIN_METHODS

    assert {s.name for s in BUILTIN_METHODS} <= set(method_names())
    for spec in BUILTIN_METHODS:
        cls = editor_class(spec.name)
        assert (cls.name, cls.summary, cls.Config) == (spec.name, spec.summary, spec.Config)
        assert f"{cls.__module__}:{cls.__qualname__}" == spec.editor and spec.summary
    assert method_spec("lora").shared == {"lr": 5e-3}
    with pytest.raises(CrispEditError, match="unknown method 'rome'; choose one of adam-nscl, alphaedit, crispedit"):
        method_spec("rome")


def test_a_catalogued_editor_may_not_restate_its_summary():
    from crispedit.editing.editor import Editor
    from crispedit.editing.registry import register_editor

    class Twice(Editor):
        name = "ft"
        summary = "another summary"

    Twice.__module__, Twice.__qualname__ = "crispedit.methods.ft", "FTEditor"
    with pytest.raises(ValueError, match="the catalogue entry of 'ft' holds them"):
        register_editor(Twice)


METHOD_MODULE = """
from dataclasses import dataclass

from crispedit.editing.editor import Editor
from crispedit.editing.registry import MethodConfig, MethodSpec


@dataclass
class HalfConfig(MethodConfig):
    share: float = 0.5


METHOD = MethodSpec("half-ft", "fine-tuning of half the edit layers", HalfConfig, f"{__name__}:HalfFTEditor")


class HalfFTEditor(Editor):
    name = "half-ft"
"""


def test_a_method_is_one_module_that_discovery_finds(tmp_path, monkeypatch):
    """One module with a ``METHOD`` in a methods package is all a method needs: :func:`discover` adds it to the
    catalogue (options and summary known, the editor loaded only when asked for, bound to its entry); a public
    module of the package without a ``METHOD`` is refused."""
    import importlib

    from crispedit.editing.registry import EDITORS, editor_class, method_names, method_spec
    from crispedit.methods import discover

    pkg = tmp_path / "more_methods"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_helpers.py").write_text("X = 1\n")  # private: not a method
    (pkg / "half_ft.py").write_text(METHOD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert [s.name for s in discover("more_methods")] == ["half-ft"] and "half-ft" in method_names()
        assert method_spec("half-ft").Config.from_options("half-ft", {"share": 0.25}).share == 0.25
        cls = editor_class("half-ft")
        assert (cls.__name__, cls.summary, cls.Config) == (
            "HalfFTEditor",
            method_spec("half-ft").summary,
            method_spec("half-ft").Config,
        )
        (pkg / "notes.py").write_text("X = 1\n")
        importlib.invalidate_caches()
        with pytest.raises(TypeError, match="more_methods.notes defines no METHOD"):
            discover("more_methods")
    finally:
        EDITORS.pop("half-ft", None)
        for name in [m for m in sys.modules if m == "more_methods" or m.startswith("more_methods.")]:
            monkeypatch.delitem(sys.modules, name)


MODULE_PROBE = """
import json, runpy, sys
sys.argv = ["crispedit", *json.loads(sys.argv[1])]
try:
    runpy.run_module("crispedit", run_name="__main__")
    rc = None
except SystemExit as exc:  # __main__ exits with main()'s status
    rc = exc.code
print(json.dumps({{"rc": rc, "heavy": sorted(m for m in {heavy!r} if m in sys.modules)}}))
"""


@pytest.mark.parametrize(
    "world_size,argv,rc,text",
    [
        (None, ["cache", "build", "--help"], 0, "usage: crispedit cache build"),
        ("2", ["report", "run.json"], 2, "only `cache build`, `edit` and `session add` run under torchrun"),
    ],
    ids=["help", "report-under-torchrun"],
)
def test_python_dash_m_is_torch_free_too(world_size, argv, rc, text, tmp_path):
    # `torchrun -m crispedit` runs crispedit/__main__.py; its start-up and refusals are as cheap as the script's
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.pop("WORLD_SIZE", None)
    if world_size:
        env["WORLD_SIZE"] = world_size
    proc = subprocess.run(
        [sys.executable, "-c", MODULE_PROBE.format(heavy=HEAVY), json.dumps(argv)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    rep = json.loads(proc.stdout.rstrip("\n").split("\n")[-1])
    assert rep == {"rc": rc, "heavy": []}, (rep, proc.stderr)
    assert text in (proc.stdout + proc.stderr)
