"""Bad inputs and faults across every sub-command: each ends in exit != 0, no traceback, exactly one
``crispedit: error:`` line naming the problem, and nothing written.

One row per case. A row builds its inputs in ``tmp_path`` and returns the argv; the test snapshots
``tmp_path`` (every file's bytes; the private curvature cache excepted) before and after and requires it
unchanged. Checks that happen before any model is loaded use the tiny model directory only as a name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from crispedit.cli import main

LAYERS = "model.layers.{1-2}.mlp.down_proj"
NAMES = ["model.layers.1.mlp.down_proj", "model.layers.2.mlp.down_proj"]
LATIN1 = "Caf\xe9 na\xefve text in Latin-1.\n\nA second paragraph \xe0 la mode.\n".encode("latin-1")


def _edits(tmp: Path, n: int = 4) -> Path:
    recs = [
        {
            "src": f"Who founded club {i}?",
            "alt": f"Founder {chr(65 + i)}",
            "rephrase": f"Club {i} was founded by?",
            "loc": "nq question: who sang it",
            "loc_ans": "someone",
        }
        for i in range(n)
    ]
    p = tmp / "edits.json"
    p.write_text(json.dumps(recs))
    return p


def _with_subjects(argv: list, tmp: Path) -> list:
    """``argv`` of :func:`_edit` with an edit file whose records carry a subject (closed-form editors)."""
    recs = [
        {"src": f"Who founded club {i}?", "alt": f"Founder {chr(65 + i)}", "subject": f"club {i}"} for i in range(2)
    ]
    p = tmp / "subject_edits.json"
    p.write_text(json.dumps(recs))
    return argv[:3] + ["--edits", p] + argv[5:]


def _edit(tmp: Path, model: Path, *extra, out: Path | None = None) -> list:
    return [
        "edit",
        "--model",
        model,
        "--edits",
        _edits(tmp),
        "--layers",
        LAYERS,
        "--n-cap",
        4,
        "--max-len",
        32,
        "--epochs",
        2,
        "--out",
        out or tmp / "out",
        "--quiet",
        *extra,
    ]


def _file(tmp: Path, name: str, data: bytes | str = "x") -> Path:
    p = tmp / name
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return p


def _cache(
    tmp: Path,
    model: Path,
    *,
    n_cap: int = 4,
    max_len: int = 32,
    label_mode: str = "sampled",
    size: tuple[int, int] | None = None,
) -> Path:
    """A factor file for the tiny model built with the given settings (identity factors)."""
    from crispedit.curvature.cache import save_factors
    from crispedit.curvature.factors import KFACFactors
    from crispedit.editing import EditConfig, curvature_spec
    from crispedit.models import load_model

    m, _ = load_model(str(model))
    d_in, d_out = size or (48, 32)
    f = KFACFactors({n: torch.eye(d_in) for n in NAMES}, {n: torch.eye(d_out) for n in NAMES}, 10)
    cfg = EditConfig(n_cap=n_cap, max_len=max_len, label_mode=label_mode, layers=LAYERS)
    spec = curvature_spec(m, NAMES, cfg)
    return save_factors(tmp / "factors.safetensors", f, spec)


def _model_variant(tmp: Path, model: Path, kind: str) -> Path:
    d = tmp / f"model-{kind}"
    shutil.copytree(model, d)
    if kind == "remote":
        cfg = json.loads((d / "config.json").read_text())
        cfg["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"}
        (d / "config.json").write_text(json.dumps(cfg))
        (d / "configuration_x.py").write_text("raise SystemExit('remote code ran')\n")
    elif kind == "pickled":
        from safetensors.torch import load_file

        torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
        (d / "model.safetensors").unlink()
    elif kind == "nonfinite":  # an edit layer that already holds inf: the edited weights are non-finite
        from safetensors.torch import load_file, save_file

        sd = load_file(d / "model.safetensors")
        sd["model.layers.1.mlp.down_proj.weight"][0, 0] = float("inf")
        save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    return d


def _session(tmp: Path, model: Path, state, *, version: str | None = None) -> Path:
    """A session directory whose session.json is valid (written by this crispedit, or by ``version``) and whose
    state.json is ``state`` (an object gets this crispedit's version and format)."""
    from crispedit.editing.contexts import DEFAULT_CONTEXTS
    from crispedit.sessions.sequential import SeqConfig
    from crispedit.versions import VERSION_KEY, stamped

    d = tmp / "sess"
    d.mkdir()
    meta = stamped(
        {
            "format": 1,
            "name": "crispedit-seq",
            "created": "now",
            "layers": NAMES,
            "base": {"spec": str(model), "fingerprint": "0" * 32, "dtype": "float32", "model_type": "llama"},
            "config": SeqConfig().to_json(),
            "default_contexts": DEFAULT_CONTEXTS,
        }
    )
    if version is not None:
        meta[VERSION_KEY] = version
    (d / "session.json").write_text(json.dumps(meta))
    (d / "state.json").write_text(json.dumps(stamped({"format": 1, **state}) if isinstance(state, dict) else state))
    return d


def _run_file(tmp: Path, name: str = "run.json", version: str | None = None) -> Path:
    """A ``crispedit eval`` result file written by this crispedit (or claiming ``version``)."""
    from crispedit.versions import VERSION_KEY, stamped

    run = stamped(
        {
            "edit": {"rel": 0.5, "gen": 0.25},
            "capabilities": {},
            "config": {"model": "m", "protocol": "wild", "context": "qa"},
        }
    )
    if version is not None:
        run[VERSION_KEY] = version
    return _file(tmp, name, json.dumps(run))


def _older(tmp: Path, path: Path, key: str) -> Path:
    """``path`` (a crispedit safetensors file, its metadata under ``key``) rewritten as crispedit 0.0.9 wrote it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from crispedit.versions import VERSION_KEY

    with safe_open(str(path), framework="pt") as fh:
        meta, tensors = dict(fh.metadata()), {k: fh.get_tensor(k) for k in fh.keys()}
    meta[key] = json.dumps({**json.loads(meta[key]), VERSION_KEY: "0.0.9"})
    save_file(tensors, str(path), metadata=meta)
    return path


def _config_dir(tmp: Path, config: dict | None) -> Path:
    """A directory holding only ``config.json`` (``config``; none when ``None``): a model directory by its looks."""
    d = tmp / "cfg-only"
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return d


def _readonly_dir(tmp: Path) -> Path:
    d = tmp / "ro"
    d.mkdir()
    d.chmod(0o555)
    return d


ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
needs_non_root = pytest.mark.skipif(ROOT, reason="root may write anywhere: permission bits are not enforced")
# A directory under /proc: a virtual file system where creating a file fails (ENOENT) although the permission
# bits allow it (os.access says writable, for root too) — the destination must be checked by trying it.
VIRTUAL = Path("/proc/crispedit-no-such-dir")
needs_proc = pytest.mark.skipif(
    not (Path("/proc/self").is_dir() and os.access("/proc", os.W_OK)),
    reason="needs a /proc that the permission bits call writable",
)


def _virtual(case: str, build, msg: str = "cannot write in /proc"):
    """A row whose output lies under :data:`VIRTUAL` (skipped without a suitable /proc)."""
    return pytest.param(case, build, msg, marks=needs_proc)


def _delta(tmp: Path, model: Path, *, other_base: bool = False) -> Path:
    """A delta file of a one-weight change of ``model`` (or, with ``other_base``, of a model that is not it)."""
    import torch

    from crispedit.delta import write_delta
    from crispedit.models import load_model

    m, _ = load_model(str(model))
    name = "model.layers.1.mlp.down_proj.weight"
    w = m.get_parameter(name)
    with torch.no_grad():
        if other_base:
            w[1, 1] += 1.0
        base = {name: w.detach().clone()}
        w[0, 0] += 0.5
    path = tmp / "d.safetensors"
    write_delta(path, m, base, {"method": "test"})
    return path


# (id, builder(tmp, model) -> argv, expected text in the one error line)
CASES = [
    # 1. text files that are not UTF-8
    (
        "edits-not-utf8",
        lambda t, m: _edit(t, m)[:3] + ["--edits", _file(t, "e.json", b'[{"src": "\xff"}]')] + _edit(t, m)[5:],
        "is not UTF-8",
    ),
    ("cap-corpus-not-utf8", lambda t, m: _edit(t, m, "--cap-corpus", _file(t, "c.txt", LATIN1)), "is not UTF-8"),
    ("kl-text-not-utf8", lambda t, m: _edit(t, m, "--kl-text", _file(t, "k.txt", LATIN1)), "is not UTF-8"),
    ("report-run-not-utf8", lambda t, m: ["report", _file(t, "run.json", LATIN1), "--out", t / "r.md"], "is not UTF-8"),
    ("edits-is-directory", lambda t, m: _edit(t, m)[:3] + ["--edits", t] + _edit(t, m)[5:], "is a directory"),
    # 2. output destinations checked before any work
    ("edit-out-is-file", lambda t, m: _edit(t, m, out=_file(t, "out")), "is a file, not a directory"),
    ("edit-out-under-file", lambda t, m: _edit(t, m, out=_file(t, "f") / "out"), "is a file, not a directory"),
    ("edit-checkpoint-is-dir", lambda t, m: _edit(t, m, "--checkpoint", t), "is a directory"),
    (
        "edit-checkpoint-foreign",
        lambda t, m: _edit(t, m, "--checkpoint", _file(t, "ck.safetensors", b"\x02" + b"\0" * 7 + b"{}")),
        "is not a crispedit training checkpoint",
    ),
    (
        "eval-out-is-dir",
        lambda t, m: ["eval", "--model", m, "--edits", _edits(t), "--out", t, "--quiet"],
        "is a directory",
    ),
    (
        "eval-out-under-file",
        lambda t, m: ["eval", "--model", m, "--edits", _edits(t), "--out", _file(t, "f") / "r.json"],
        "is a file, not a directory",
    ),
    (
        "study-out-is-file",
        lambda t, m: ["study", "mnist", "--quick", "--out", _file(t, "s")],
        "is a file, not a directory",
    ),
    (
        "report-png-under-file",
        lambda t, m: ["report", _run_file(t), "--out", t / "r.md", "--png", _file(t, "f") / "r.png"],
        "--png",
    ),
    ("report-out-is-dir", lambda t, m: ["report", _run_file(t), "--out", t], "is a directory"),
    (
        "session-plot-out-is-dir",
        lambda t, m: ["session", "plot", _session(t, m, {"round": 0, "files": {}, "rounds": []}), "--out", t],
        "is a directory",
    ),
    (
        "session-init-out-is-file",
        lambda t, m: ["session", "init", "--model", m, "--layers", LAYERS, "--out", _file(t, "s")],
        "is a file, not a directory",
    ),
    (
        "cache-build-out-under-file",
        lambda t, m: ["cache", "build", "--model", m, "--layers", LAYERS, "--out", _file(t, "f") / "c.safetensors"],
        "is a file, not a directory",
    ),
    (
        "compare-out-is-file",
        lambda t, m: [
            "compare",
            "--model",
            m,
            "--edits",
            _edits(t),
            "--n-edits",
            2,
            "--methods",
            "ft",
            "--out",
            _file(t, "c"),
        ],
        "is a file, not a directory",
    ),
    pytest.param(
        "edit-out-unwritable",
        lambda t, m: _edit(t, m, out=_readonly_dir(t) / "out"),
        "permission denied",
        marks=needs_non_root,
    ),
    pytest.param(
        "eval-out-unwritable",
        lambda t, m: ["eval", "--model", m, "--edits", _edits(t), "--out", _readonly_dir(t) / "r.json"],
        "permission denied",
        marks=needs_non_root,
    ),
    # 3. errors of the libraries underneath
    ("remote-code", lambda t, m: _edit(t, _model_variant(t, m, "remote")), "pass --trust-remote-code"),
    ("pickled-weights", lambda t, m: _edit(t, _model_variant(t, m, "pickled")), "pickled"),
    ("unknown-device", lambda t, m: _edit(t, m, "--device", "quantum"), "unknown --device 'quantum'"),
    (
        "absent-cuda",
        lambda t, m: (
            _edit(t, m, "--device", "cuda:7")
            if not torch.cuda.is_available() or torch.cuda.device_count() < 8
            else pytest.skip("8 GPUs")
        ),
        "cuda:7",
    ),
    (
        "eval-unknown-device",
        lambda t, m: ["eval", "--model", m, "--edits", _edits(t), "--device", "gpu0", "--out", t / "r.json"],
        "unknown --device",
    ),
    # 4. numbers that make no sense, and never saving non-finite weights
    ("lr-inf", lambda t, m: _edit(t, m, "--lr", "inf"), "--lr) must be a finite number"),
    ("lr-nan", lambda t, m: _edit(t, m, "--lr", "nan"), "--lr) must be a finite number"),
    ("lr-huge", lambda t, m: _edit(t, m, "--lr", "1e30"), "--lr) must lie in (0, 1]"),
    ("gamma-nan", lambda t, m: _edit(t, m, "--gamma", "nan"), "gamma"),
    ("seed-huge", lambda t, m: _edit(t, m, "--seed", 2**70), "seed must be between 0 and"),
    ("seed-negative", lambda t, m: _edit(t, m, "--seed", -1), "seed must be between 0 and"),
    ("epochs-huge", lambda t, m: _edit(t, m, "--epochs", 10**9), "epochs must be between"),
    ("plateau-negative", lambda t, m: _edit(t, m, "--plateau", -1), "plateau epochs (--plateau) must be between"),
    (
        "memit-no-subject",
        lambda t, m: _edit(t, m, "--method", "memit"),
        "edit request 0 ('Who founded club 0?') has no subject",
    ),
    (
        "memit-kfac-cache",
        lambda t, m: _with_subjects(_edit(t, m, "--method", "memit", "--cache", _cache(t, m)), t),
        "holds kfac statistics, not input",
    ),
    (
        "memit-cov-weight-0",
        lambda t, m: _edit(t, m, "--method", "memit", "--memit-cov-weight", 0),
        "memit cov_weight must be positive",
    ),
    (
        "alphaedit-threshold-nan",
        lambda t, m: _edit(t, m, "--method", "alphaedit", "--alphaedit-nullspace-threshold", "nan"),
        "alphaedit nullspace_threshold must be a finite",
    ),
    ("mend-no-network", lambda t, m: _edit(t, m, "--method", "mend"), "no trained MEND network"),
    (
        "mend-weights-absent",
        lambda t, m: _edit(t, m, "--method", "mend", "--mend-weights", t / "absent.safetensors"),
        "MEND network file (--mend-weights) not found",
    ),
    (
        "mend-weights-not-mend",
        lambda t, m: _edit(t, m, "--method", "mend", "--mend-weights", _cache(t, m)),
        "is not a crispedit MEND network",
    ),
    (
        "mend-train-rank-0",
        lambda t, m: ["mend", "train", "--model", m, "--edits", _edits(t), "--offset", 0, "--rank", 0],
        "mend rank must be between 1 and",
    ),
    (
        "mend-train-lr-nan",
        lambda t, m: ["mend", "train", "--model", m, "--edits", _edits(t), "--lr", "nan"],
        "mend lr must be a finite number",
    ),
    (
        "mend-train-out-is-dir",
        lambda t, m: ["mend", "train", "--model", m, "--edits", _edits(t), "--offset", 0, "--out", t],
        "is a directory",
    ),
    (
        "lora-alpha-inf",
        lambda t, m: _edit(t, m, "--method", "lora", "--lora-alpha", "inf"),
        "lora alpha must be a finite",
    ),
    (
        "session-sequential-mend",
        lambda t, m: ["session", "init", "--model", m, "--out", t / "s", "--method", "mend"],
        "mend has no sequential mode",
    ),
    (
        "session-mix-nan",
        lambda t, m: ["session", "init", "--model", m, "--out", t / "s", "--mix", "nan"],
        "mix must be a finite number",
    ),
    (
        "study-seed-huge",
        lambda t, m: ["study", "mnist", "--quick", "--seed", 2**40, "--out", t / "s"],
        "seed must be between",
    ),
    ("study-k-inf", lambda t, m: ["study", "mnist", "--quick", "--k-values", "inf", "--out", t / "s"], "k values"),
    ("demo-gamma-inf", lambda t, m: ["demo", "--model", m, "--gamma", "inf"], "gamma"),
    ("demo-n-edits-0", lambda t, m: ["demo", "--model", m, "--n-edits", 0], "--n-edits must be a positive integer"),
    (
        "playground-port-out-of-range",
        lambda t, m: ["playground", "--model", m, "--port", 70000],
        "--port must be between 0 and 65535, got 70000",
    ),
    (
        "playground-kl-text-missing",
        lambda t, m: ["playground", "--model", m, "--kl-text", t / "none.txt"],
        "text file not found",
    ),
    (
        "eval-offset-negative",
        lambda t, m: ["eval", "--model", m, "--edits", _edits(t), "--offset", -3, "--out", t / "r.json"],
        "--offset must be non-negative",
    ),
    (
        "compare-limit-0",
        lambda t, m: [
            "compare",
            "--model",
            m,
            "--edits",
            _edits(t),
            "--n-edits",
            2,
            "--methods",
            "ft",
            "--limit",
            0,
            "--out",
            t / "c",
        ],
        "--limit must be a positive integer",
    ),
    (
        "compare-seq-chunk-without-seq",
        lambda t, m: [
            "compare",
            "--model",
            m,
            "--edits",
            _edits(t),
            "--n-edits",
            2,
            "--methods",
            "ft",
            "--seq-chunk",
            2,
            "--out",
            t / "c",
        ],
        "--seq-chunk sets the round size of the -seq rows, and none is being run",
    ),
    ("argparse-bad-int", lambda t, m: _edit(t, m, "--n-cap", "four"), "argument --n-cap: invalid int value"),
    (
        "edit-loss-nan",
        lambda t, m: _edit(t, _model_variant(t, m, "nonfinite"), "--method", "ft"),
        "the edit loss became nan in epoch 1",
    ),
    # 5. a cache file built for another configuration, or with factors of the wrong size
    ("cache-other-max-len", lambda t, m: _edit(t, m, "--cache", _cache(t, m, max_len=64)), "max_len=64 (asked: 32)"),
    ("cache-other-n-cap", lambda t, m: _edit(t, m, "--cache", _cache(t, m, n_cap=8)), "n_texts=8 (asked: 4)"),
    (
        "cache-other-labels",
        lambda t, m: _edit(t, m, "--cache", _cache(t, m, label_mode="empirical")),
        "label_mode='empirical' (asked: 'sampled')",
    ),
    (
        "cache-other-corpus",
        lambda t, m: _edit(
            t, m, "--cache", _cache(t, m), "--cap-corpus", _file(t, "c.txt", "one.\n\ntwo.\n\nthree.\n\nfour.\n")
        ),
        "corpus_digest=",
    ),
    (
        "cache-wrong-shape",
        lambda t, m: _edit(t, m, "--cache", _cache(t, m, size=(16, 16))),
        "factors for model.layers.1.mlp.down_proj are for a 16x16 layer, this layer is 32x48",
    ),
    # 6. messages that name the actual problem
    ("offset-past-end", lambda t, m: _edit(t, m, "--offset", 9), "--offset 9 is past the end"),
    (
        "edits-json-object",
        lambda t, m: _edit(t, m)[:3] + ["--edits", _file(t, "o.json", '{"a": 1}\n{"b": [')] + _edit(t, m)[5:],
        "malformed JSON on line 2",
    ),
    ("session-state-list", lambda t, m: ["session", "status", _session(t, m, [1, 2])], "malformed: a JSON list"),
    (
        "session-state-no-files",
        lambda t, m: ["session", "status", _session(t, m, {"round": 0, "rounds": []})],
        "malformed: no 'files'",
    ),
    (
        "session-state-rounds-mismatch",
        lambda t, m: ["session", "status", _session(t, m, {"round": 2, "files": {}, "rounds": []})],
        "round 2 with 0 round records",
    ),
    (
        "session-state-bad-record",
        lambda t, m: ["session", "status", _session(t, m, {"round": 1, "files": {}, "rounds": [{"round": 1}]})],
        "(round 1) is malformed: no 'n_edits'",
    ),
    (
        "report-run-wrong-shape",
        lambda t, m: ["report", _file(t, "run.json", '{"edit": [], "capabilities": {}}')],
        "not a `crispedit eval` result",
    ),
    # files another crispedit version wrote: refused in one line naming that version
    (
        "session-other-version",
        lambda t, m: ["session", "status", _session(t, m, {"round": 0, "files": {}, "rounds": []}, version="0.0.9")],
        "was written by crispedit 0.0.9; this is crispedit",
    ),
    (
        "report-run-other-version",
        lambda t, m: ["report", _run_file(t, version="0.0.9")],
        "run.json was written by crispedit 0.0.9; this is crispedit",
    ),
    (
        "delta-other-version",
        lambda t, m: ["delta", "info", _older(t, _delta(t, m), "crispedit_delta")],
        "d.safetensors was written by crispedit 0.0.9; this is crispedit",
    ),
    (
        "cache-other-version",
        lambda t, m: _edit(t, m, "--cache", _older(t, _cache(t, m), "crispedit")),
        "was written by crispedit 0.0.9; this is crispedit",
    ),
    (
        "edit-overwrite-other-version",
        lambda t, m: _edit(
            t,
            m,
            "--overwrite",
            out=_file(t, "edit_report.json", json.dumps({"crispedit_version": "0.0.9", "files": []})).parent,
        ),
        "edit_report.json was written by crispedit 0.0.9; this is crispedit",
    ),
    # 7. a non-empty --out is refused unless --overwrite (and then only an earlier crispedit output)
    ("edit-out-not-empty", lambda t, m: _edit(t, m, out=_file(t, "keep.txt").parent), "is not empty; pass --overwrite"),
    (
        "edit-overwrite-foreign",
        lambda t, m: _edit(t, m, "--overwrite", out=_file(t, "keep.txt").parent),
        "holds no earlier crispedit output",
    ),
    # delta files: a model that is not the delta's base / edited model
    (
        "delta-apply-other-base",
        lambda t, m: ["delta", "apply", _delta(t, m, other_base=True), "--model", m, "--out", t / "o", "--quiet"],
        "is not the base of delta",
    ),
    (
        "delta-revert-on-base",
        lambda t, m: ["delta", "revert", _delta(t, m), "--model", m, "--out", t / "o", "--quiet"],
        "is not applied to this model",
    ),
    (
        "delta-export-lora-other-base",
        lambda t, m: [
            "delta",
            "export-lora",
            _delta(t, m, other_base=True),
            "--model",
            m,
            "--rank",
            2,
            "--out",
            t / "o",
            "--quiet",
        ],
        "is not the base of delta",
    ),
    (
        "delta-export-lora-rank-too-large",
        lambda t, m: ["delta", "export-lora", _delta(t, m), "--model", m, "--rank", 2**70, "--out", t / "o", "--quiet"],
        "at most 32 (min(d_out, d_in)",
    ),
    (
        "delta-apply-out-is-file",
        lambda t, m: ["delta", "apply", _delta(t, m), "--model", m, "--out", _file(t, "o")],
        "is a file, not a directory",
    ),
    # export gguf: everything is checked before the model loads; only llama-family models
    (
        "export-gguf-missing-dir",
        lambda t, m: ["export", "gguf", t / "none", "--out", t / "x.gguf"],
        "model directory not found",
    ),
    (
        "export-gguf-model-is-file",
        lambda t, m: ["export", "gguf", _file(t, "m"), "--out", t / "x.gguf"],
        "is a file, not a directory",
    ),
    (
        "export-gguf-not-a-model-dir",
        lambda t, m: ["export", "gguf", _config_dir(t, None), "--out", t / "x.gguf"],
        "is not a Hugging Face model directory (no config.json)",
    ),
    (
        "export-gguf-non-llama",
        lambda t, m: ["export", "gguf", _config_dir(t, {"model_type": "gpt2"}), "--out", t / "x.gguf"],
        "is a gpt2 model",
    ),
    (
        "export-gguf-rope-scaling",
        lambda t, m: [
            "export",
            "gguf",
            _config_dir(t, {"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
            "--out",
            t / "x.gguf",
        ],
        "uses rope scaling 'llama3'",
    ),
    ("export-gguf-out-is-dir", lambda t, m: ["export", "gguf", m, "--out", t], "is a directory; give a file name"),
    (
        "export-gguf-type",
        lambda t, m: ["export", "gguf", m, "--out", t / "x.gguf", "--type", "q4_k"],
        "invalid choice: 'q4_k'",
    ),
    (
        "export-gguf-nonfinite",
        lambda t, m: ["export", "gguf", _model_variant(t, m, "nonfinite"), "--out", t / "x.gguf", "--quiet"],
        "holds non-finite weights",
    ),
    # 8. a destination whose parent takes no new entry although its permission bits allow it: tried
    # with a probe file before any work, for every sub-command that writes
    _virtual("edit-out-on-virtual-fs", lambda t, m: _edit(t, m, out=VIRTUAL / "out")),
    _virtual(
        "eval-out-on-virtual-fs", lambda t, m: ["eval", "--model", m, "--edits", _edits(t), "--out", VIRTUAL / "r.json"]
    ),
    _virtual(
        "report-png-on-virtual-fs",
        lambda t, m: ["report", _run_file(t), "--out", t / "r.md", "--png", VIRTUAL / "r.png"],
    ),
    _virtual("report-out-on-virtual-fs", lambda t, m: ["report", _run_file(t), "--out", VIRTUAL / "r.md"]),
    _virtual(
        "cache-build-out-on-virtual-fs",
        lambda t, m: ["cache", "build", "--model", m, "--layers", LAYERS, "--out", VIRTUAL / "c.safetensors"],
    ),
    _virtual(
        "cache-build-cache-dir-on-virtual-fs",
        lambda t, m: ["cache", "build", "--model", m, "--layers", LAYERS, "--cache-dir", VIRTUAL],
    ),
    _virtual(
        "session-init-out-on-virtual-fs",
        lambda t, m: ["session", "init", "--model", m, "--layers", LAYERS, "--out", VIRTUAL / "s"],
    ),
    _virtual(
        "session-export-out-on-virtual-fs",
        lambda t, m: [
            "session",
            "export",
            _session(t, m, {"round": 0, "files": {}, "rounds": []}),
            "--out",
            VIRTUAL / "e",
        ],
    ),
    _virtual(
        "session-plot-out-on-virtual-fs",
        lambda t, m: [
            "session",
            "plot",
            _session(t, m, {"round": 0, "files": {}, "rounds": []}),
            "--out",
            VIRTUAL / "p.png",
        ],
    ),
    _virtual(
        "compare-out-on-virtual-fs",
        lambda t, m: [
            "compare",
            "--model",
            m,
            "--edits",
            _edits(t),
            "--n-edits",
            2,
            "--methods",
            "ft",
            "--out",
            VIRTUAL / "c",
        ],
    ),
    _virtual(
        "delta-apply-out-on-virtual-fs",
        lambda t, m: ["delta", "apply", _delta(t, m), "--model", m, "--out", VIRTUAL / "o"],
    ),
    _virtual("export-gguf-out-on-virtual-fs", lambda t, m: ["export", "gguf", m, "--out", VIRTUAL / "x.gguf"]),
    _virtual(
        "mend-train-out-on-virtual-fs",
        lambda t, m: [
            "mend",
            "train",
            "--model",
            m,
            "--edits",
            _edits(t),
            "--offset",
            0,
            "--out",
            VIRTUAL / "m.safetensors",
        ],
    ),
    _virtual(
        "mend-train-cache-dir-on-virtual-fs",
        lambda t, m: ["mend", "train", "--model", m, "--edits", _edits(t), "--offset", 0, "--cache-dir", VIRTUAL],
    ),
    _virtual("study-out-on-virtual-fs", lambda t, m: ["study", "mnist", "--quick", "--out", VIRTUAL / "s"]),
    # 9. every path option of the wrong kind (a file where a directory belongs, or the reverse): one line, before
    # any work
    (
        "cache-build-cache-dir-is-file",
        lambda t, m: ["cache", "build", "--model", m, "--layers", LAYERS, "--cache-dir", _file(t, "c")],
        "--cache-dir",
    ),
    (
        "cache-list-cache-dir-is-file",
        lambda t, m: ["cache", "list", "--cache-dir", _file(t, "c")],
        "is a file, not a directory",
    ),
    ("cache-info-file-is-dir", lambda t, m: ["cache", "info", t], "is a directory, not a file"),
    (
        "mend-train-cache-dir-is-file",
        lambda t, m: [
            "mend",
            "train",
            "--model",
            m,
            "--edits",
            _edits(t),
            "--offset",
            0,
            "--steps",
            1,
            "--cache-dir",
            _file(t, "c"),
        ],
        "is a file, not a directory",
    ),
    (
        "mend-train-init-is-dir",
        lambda t, m: ["mend", "train", "--model", m, "--edits", _edits(t), "--offset", 0, "--init", t],
        "is a directory, not a file",
    ),
    (
        "mend-train-cap-corpus-is-dir",
        lambda t, m: ["mend", "train", "--model", m, "--edits", _edits(t), "--offset", 0, "--cap-corpus", t],
        "is a directory, not a file",
    ),
    ("edit-cache-is-dir", lambda t, m: _edit(t, m, "--cache", t), "is a directory, not a file"),
    ("edit-cap-corpus-is-dir", lambda t, m: _edit(t, m, "--cap-corpus", t), "is a directory, not a file"),
    ("edit-kl-text-is-dir", lambda t, m: _edit(t, m, "--kl-text", t), "is a directory, not a file"),
    (
        "edit-mend-weights-is-dir",
        lambda t, m: _edit(t, m, "--method", "mend", "--mend-weights", t),
        "is a directory, not a file",
    ),
    (
        "edit-model-is-file",
        lambda t, m: _edit(t, _file(t, "model.txt")),
        "is neither a model directory nor a .gguf file",
    ),
    (
        "eval-bench-dir-is-file",
        lambda t, m: [
            "eval",
            "--model",
            m,
            "--capabilities",
            "arc_challenge",
            "--bench-dir",
            _file(t, "b"),
            "--out",
            t / "r.json",
        ],
        "benchmark directory",
    ),
    (
        "eval-edits-is-dir",
        lambda t, m: ["eval", "--model", m, "--edits", t, "--out", t / "r.json"],
        "is a directory, not a file",
    ),
    ("report-run-is-dir", lambda t, m: ["report", t], "is a directory, not a file"),
    (
        "compare-bench-dir-is-file",
        lambda t, m: [
            "compare",
            "--model",
            m,
            "--edits",
            _edits(t),
            "--n-edits",
            2,
            "--methods",
            "ft",
            "--capabilities",
            "arc_challenge",
            "--bench-dir",
            _file(t, "b"),
            "--out",
            t / "c",
        ],
        "benchmark directory",
    ),
    (
        "study-data-is-file",
        lambda t, m: ["study", "mnist", "--quick", "--data", _file(t, "d"), "--out", t / "s"],
        "data directory",
    ),
    (
        "session-add-dir-is-file",
        lambda t, m: ["session", "add", _file(t, "s"), "--edits", _edits(t)],
        "session directory",
    ),
    ("session-status-dir-is-file", lambda t, m: ["session", "status", _file(t, "s")], "is a file, not a directory"),
    (
        "session-export-dir-is-file",
        lambda t, m: ["session", "export", _file(t, "s"), "--out", t / "e"],
        "is a file, not a directory",
    ),
    (
        "session-plot-dir-is-file",
        lambda t, m: ["session", "plot", _file(t, "s"), "--out", t / "p.png"],
        "is a file, not a directory",
    ),
    (
        "session-init-cache-is-dir",
        lambda t, m: ["session", "init", "--model", m, "--layers", LAYERS, "--cache", t, "--out", t / "s"],
        "is a directory, not a file",
    ),
    ("delta-info-file-is-dir", lambda t, m: ["delta", "info", t], "is a directory, not a file"),
    # 10. mend train's numbers get edit's range checks, before any model loads (steps 0 saved an untrained network)
    (
        "mend-train-steps-0",
        lambda t, m: [
            "mend",
            "train",
            "--model",
            m,
            "--edits",
            _edits(t),
            "--offset",
            0,
            "--steps",
            0,
            "--out",
            t / "m.safetensors",
        ],
        "mend steps must be between 1 and",
    ),
    (
        "mend-train-batch-size-negative",
        lambda t, m: ["mend", "train", "--model", m, "--edits", _edits(t), "--offset", 0, "--batch-size", -4],
        "mend batch_size must be between 1 and",
    ),
    (
        "mend-train-lr-0",
        lambda t, m: ["mend", "train", "--model", m, "--edits", _edits(t), "--offset", 0, "--lr", 0],
        "mend lr must lie in (0, 1]",
    ),
    (
        "mend-train-lr-huge",
        lambda t, m: ["mend", "train", "--model", m, "--edits", _edits(t), "--offset", 0, "--lr", 5],
        "mend lr must lie in (0, 1]",
    ),
    (
        "mend-train-max-minutes-0",
        lambda t, m: ["mend", "train", "--model", m, "--edits", _edits(t), "--offset", 0, "--max-minutes", 0],
        "--max-minutes must be positive",
    ),
    (
        "mend-train-max-minutes-inf",
        lambda t, m: ["mend", "train", "--model", m, "--edits", _edits(t), "--offset", 0, "--max-minutes", "inf"],
        "--max-minutes must be a finite number",
    ),
    (
        "mend-train-n-cap-0",
        lambda t, m: ["mend", "train", "--model", m, "--edits", _edits(t), "--offset", 0, "--n-cap", 0],
        "--n-cap must be a positive integer",
    ),
]


def _snapshot(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if rel.parts[0] == "cache":  # the private curvature cache (a legitimate by-product, never an output)
            continue
        out[str(rel)] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _param(c):
    return pytest.param(*c.values, marks=c.marks, id=c.values[0]) if hasattr(c, "marks") else pytest.param(*c, id=c[0])


@pytest.mark.parametrize("case,build,msg", [_param(c) for c in CASES])
def test_bad_input(case, build, msg, tiny_model_dir, tmp_path, iso_cache, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default output name (e.g. the study's) would land here
    argv = [str(a) for a in build(tmp_path, tiny_model_dir)]
    capsys.readouterr()  # drop what building the inputs printed
    before = _snapshot(tmp_path)
    try:
        code = main(argv)
    finally:
        for p in tmp_path.rglob("ro"):
            p.chmod(0o755)
    out, err = capsys.readouterr()
    assert code not in (0, None), f"{case}: exit 0\n{out}\n{err}"
    assert "Traceback" not in err and "Traceback" not in out, err
    lines = [ln for ln in err.splitlines() if "crispedit: error:" in ln]
    assert len(lines) == 1 and lines[0].startswith("crispedit: error:"), err
    assert msg in lines[0], lines[0]
    assert _snapshot(tmp_path) == before, f"{case}: something was written"


def test_matrix_covers_every_subcommand():
    """Each sub-command a user can call appears in at least one row."""
    from crispedit.cli import build_parser

    rows = " ".join(c.values[0] if hasattr(c, "marks") else c[0] for c in CASES)
    for cmd in ("edit", "eval", "report", "study", "session", "cache", "compare", "demo", "delta", "export", "mend"):
        assert cmd in rows or cmd == "edit", cmd
    assert {"edit", "cache", "demo", "eval", "report", "session", "compare", "study"} <= set(
        build_parser()._subparsers._group_actions[0].choices
    )


def test_edit_that_leaves_inf_weights_writes_nothing(tiny_lm, tmp_path, iso_cache, monkeypatch):
    """The last Adam step can make weights non-finite after the last finite loss (``--lr inf`` did, and
    exited 0): the job refuses before the atomic rename and ``out`` never appears."""
    import crispedit.pipeline as pipeline
    from crispedit.data import load_edits
    from crispedit.editing import EditConfig
    from crispedit.errors import CrispEditError

    real_edit = pipeline.edit

    def edit_then_blow_up(model, *a, **k):
        res = real_edit(model, *a, **k)
        with torch.no_grad():
            model.get_parameter(next(iter(res.original_weights))).view(-1)[3] = float("inf")
        return res

    monkeypatch.setattr(pipeline, "edit", edit_then_blow_up)
    model, tok = tiny_lm
    cfg = EditConfig(method="ft", layers=LAYERS, epochs=1, n_cap=4, max_len=32)
    with pytest.raises(
        CrispEditError, match=r"non-finite weights \(inf/nan\) in model\.layers\.1\.mlp\.down_proj\.weight"
    ):
        pipeline.run_edit_job(model, tok, load_edits(_edits(tmp_path)), cfg, tmp_path / "out", wild=False)
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_save_model_dir_refuses_non_finite(tiny_lm, tmp_path):
    from crispedit.errors import CrispEditError
    from crispedit.models import save_model_dir

    model, tok = tiny_lm
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    (tmp_path / "d").mkdir()
    with pytest.raises(CrispEditError, match=r"in model\.norm\.weight; nothing was saved"):
        save_model_dir(model, tok, tmp_path / "d")
    assert list((tmp_path / "d").iterdir()) == []


READ_ONLY_CASES = [  # (id, builder(tmp, model, ro) -> argv); ro: a directory whose file system refuses new entries
    ("edit-out", lambda t, m, ro: _edit(t, m, out=ro / "out")),
    ("edit-overwrite-into", lambda t, m, ro: _edit(t, m, out=ro)),
    ("eval-out", lambda t, m, ro: ["eval", "--model", m, "--edits", _edits(t), "--out", ro / "r.json"]),
    ("report-png", lambda t, m, ro: ["report", _run_file(t), "--out", t / "r.md", "--png", ro / "sub" / "r.png"]),
    ("cache-build-cache-dir", lambda t, m, ro: ["cache", "build", "--model", m, "--layers", LAYERS, "--cache-dir", ro]),
    (
        "compare-out",
        lambda t, m, ro: [
            "compare",
            "--model",
            m,
            "--edits",
            _edits(t),
            "--n-edits",
            2,
            "--methods",
            "ft",
            "--out",
            ro / "c",
        ],
    ),
    (
        "mend-train-out",
        lambda t, m, ro: [
            "mend",
            "train",
            "--model",
            m,
            "--edits",
            _edits(t),
            "--offset",
            0,
            "--out",
            ro / "m.safetensors",
        ],
    ),
    (
        "session-add",
        lambda t, m, ro: [
            "session",
            "add",
            _session(ro.parent, m, {"round": 0, "files": {}, "rounds": []}),
            "--edits",
            _edits(t),
        ],
    ),
]


@pytest.mark.parametrize("case,build", READ_ONLY_CASES, ids=[c[0] for c in READ_ONLY_CASES])
def test_destination_is_checked_by_trying_it(case, build, tiny_model_dir, tmp_path, iso_cache, capsys, monkeypatch):
    """A destination directory whose permission bits allow writing but whose file system refuses a new entry
    (read-only mount; simulated: creating a file in it raises EROFS) ends in one line naming the path and the
    OS's reason, before any work, with nothing written — not a traceback after the pre-check passed."""
    import errno
    import tempfile

    monkeypatch.chdir(tmp_path)
    ro = tmp_path / ("sess" if case == "session-add" else "ro-fs")
    argv = [str(a) for a in build(tmp_path, tiny_model_dir, ro)]
    ro.mkdir(exist_ok=True)
    assert os.access(ro, os.W_OK)
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*a, dir=None, **k):
        """``tempfile.mkstemp`` that fails as on a read-only mount inside ``ro``."""
        if dir is not None and Path(dir).resolve() == ro.resolve():
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
        return real_mkstemp(*a, dir=dir, **k)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    capsys.readouterr()
    before = _snapshot(tmp_path)
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, f"{case}: exit {code}\n{out}\n{err}"
    lines = [ln for ln in err.splitlines() if "crispedit: error:" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "read-only file system" in lines[0] and str(ro) in lines[0], lines[0]
    assert _snapshot(tmp_path) == before, f"{case}: something was written"


def test_probe_leaves_nothing_and_names_the_reason(tmp_path, monkeypatch):
    """:func:`check_dir_takes_entries` removes its probe file, and its error is one line with the OS's reason."""
    import errno
    import tempfile

    from crispedit.errors import CrispEditError
    from crispedit.paths import check_dir_takes_entries, check_output_file

    assert check_dir_takes_entries(tmp_path, "--out") == tmp_path and list(tmp_path.iterdir()) == []
    assert check_output_file(tmp_path / "a" / "b.json") == tmp_path / "a" / "b.json" and list(tmp_path.iterdir()) == []

    def refuse(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(CrispEditError, match=rf"^--out {tmp_path} is not writable \(no space left on device\)$"):
        check_dir_takes_entries(tmp_path, "--out")
    with pytest.raises(CrispEditError, match=r"--png .*r\.png: cannot write in .* \(no space left on device\)$"):
        check_output_file(tmp_path / "new" / "r.png", "--png")
