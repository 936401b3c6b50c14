"""Every file crispedit reads back records the crispedit version that wrote it (``versions.VERSION_KEY``), and a
file another version wrote is refused in one line naming that version — or, for a cache (curvature factors,
eigenbases, a converted GGUF), taken for a miss and rebuilt with a log line. One test per reader."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import crispedit
from crispedit.errors import CrispEditError, VersionError
from crispedit.versions import VERSION_KEY, check_written_by, stamped

OLD = "0.0.9"
NOW = crispedit.__version__


def _one_line_naming_old(exc: BaseException, where: str) -> None:
    """The refusal is one line that names the file and the version that wrote it, and this one."""
    msg = str(exc)
    assert "\n" not in msg and where in msg
    assert f"was written by crispedit {OLD}; this is crispedit {NOW} — " in msg


def _restamp(path: Path, key: str, version: str | None = OLD, **changes) -> None:
    """Rewrite safetensors file ``path`` with its crispedit metadata (under ``key``) claiming ``version`` (``None``:
    no version) and ``changes``."""
    with safe_open(str(path), framework="pt") as fh:
        meta, tensors = dict(fh.metadata()), {k: fh.get_tensor(k) for k in fh.keys()}
    record = json.loads(meta[key])
    record.pop(VERSION_KEY, None)
    record.update({VERSION_KEY: version} if version is not None else {}, **changes)
    meta[key] = json.dumps(record)
    save_file(tensors, str(path), metadata=meta)


def _crafted(path: Path, key: str, record: dict) -> Path:
    """A safetensors file holding one tensor and ``record`` as its crispedit metadata under ``key``."""
    save_file({"x": torch.zeros(2)}, str(path), metadata={key: json.dumps(record)})
    return path


# -- the helper ---------------------------------------------------------------------------------------------------
def test_check_written_by_passes_this_version_and_refuses_any_other_in_one_line():
    rec = stamped({"format": 2, "a": 1})
    assert next(iter(rec)) == VERSION_KEY and rec[VERSION_KEY] == NOW
    assert check_written_by(rec, "runs/x/compare.json", format=2) is rec
    with pytest.raises(VersionError) as e:
        check_written_by({VERSION_KEY: OLD, "format": 2}, "runs/x/compare.json", format=2)
    assert str(e.value) == f"runs/x/compare.json was written by crispedit {OLD}; this is crispedit {NOW} — rerun it"
    with pytest.raises(VersionError, match="written by a crispedit that recorded no version; this is crispedit"):
        check_written_by({"format": 2}, "f.json", "start over")
    with pytest.raises(VersionError, match=f"written by crispedit {NOW} with format 1; this crispedit writes format 2"):
        check_written_by(stamped({"format": 1}), "f.json", format=2)
    assert issubclass(VersionError, CrispEditError)


# -- edit report (and the other records beside an output: session export, delta apply) ---------------------------
def test_overwrite_refuses_an_output_directory_another_version_wrote(tmp_path):
    from crispedit.paths import check_output_dir

    out = tmp_path / "out"
    out.mkdir()
    (out / "edit_report.json").write_text(json.dumps({VERSION_KEY: OLD, "files": ["edit_report.json"]}))
    with pytest.raises(VersionError) as e:
        check_output_dir(out, overwrite=True, marker="edit_report.json")
    _one_line_naming_old(e.value, str(out / "edit_report.json"))
    (out / "edit_report.json").write_text(json.dumps(stamped({"files": ["edit_report.json", "a.bin"]})))
    assert check_output_dir(out, overwrite=True, marker="edit_report.json") == ["a.bin", "edit_report.json"]


def test_gguf_export_and_delta_apply_refuse_an_edit_report_of_another_version(tmp_path):
    from crispedit.cli.delta import _edit_report_of
    from crispedit.gguf_fields import _recorded_base, model_naming

    (tmp_path / "edit_report.json").write_text(
        json.dumps({VERSION_KEY: OLD, "model": "smollm2", "n_edits": 3, "delta": {"edited_fingerprint": "e"}})
    )
    for read in (
        lambda: _recorded_base(tmp_path),
        lambda: model_naming(tmp_path, None),
        lambda: _edit_report_of(str(tmp_path / "delta.safetensors"), {"edited_fingerprint": "e"}),
    ):
        with pytest.raises(VersionError) as e:
            read()
        _one_line_naming_old(e.value, "edit_report.json")
    (tmp_path / "edit_report.json").write_text(json.dumps(stamped({"model": "smollm2", "n_edits": 3, "method": "ft"})))
    assert _recorded_base(tmp_path) == "smollm2" and model_naming(tmp_path, None)[0].startswith("smollm2")


# -- compare.json -------------------------------------------------------------------------------------------------
def test_compare_json_of_another_version_is_refused_on_resume_and_render(tmp_path):
    from crispedit.experiments import compare_outputs, compare_resume

    path = tmp_path / compare_outputs.JSON_FILE
    path.write_text(
        json.dumps(
            {VERSION_KEY: OLD, "format": compare_outputs.COMPARE_FORMAT, "settings": {}, "methods": [], "results": {}}
        )
    )
    payload = stamped({"format": compare_outputs.COMPARE_FORMAT, "settings": {}, "methods": [], "results": {}})
    with pytest.raises(VersionError) as e:
        compare_resume.resume_payload(path, payload, [], {}, {}, 1)
    _one_line_naming_old(e.value, str(path))
    with pytest.raises(VersionError) as e:
        compare_outputs.render_outputs(tmp_path)
    _one_line_naming_old(e.value, str(path))


# -- checkpoints --------------------------------------------------------------------------------------------------
def test_training_checkpoints_of_another_version_are_refused(tmp_path):
    from crispedit.editing import checkpoint as ck
    from crispedit.sessions.in_memory import SEQ_CHECKPOINT_KIND, load_sequence_checkpoint

    loop = _crafted(tmp_path / "loop.safetensors", ck._KEY, {VERSION_KEY: OLD, "format": ck._FORMAT, "identity": "i"})
    with pytest.raises(VersionError) as e:
        ck.check_checkpoint_file(loop)  # torch-free, before any work
    _one_line_naming_old(e.value, str(loop))
    with pytest.raises(VersionError) as e:
        ck.load_checkpoint(loop, "i", {}, None)
    _one_line_naming_old(e.value, str(loop))
    closed = _crafted(tmp_path / "cf.safetensors", ck.CLOSED_FORM_KEY, {VERSION_KEY: OLD, "format": 1, "identity": "i"})
    with pytest.raises(VersionError) as e:
        ck.check_checkpoint_file(closed)
    _one_line_naming_old(e.value, str(closed))
    with pytest.raises(VersionError) as e:
        ck.load_run_file(closed, "closed-form checkpoint", ck.CLOSED_FORM_KEY, 1, "i")
    _one_line_naming_old(e.value, str(closed))
    seq = _crafted(tmp_path / "seq.safetensors", "crispedit_sequence", {VERSION_KEY: OLD, "format": 1, "identity": "i"})
    with pytest.raises(VersionError) as e:
        load_sequence_checkpoint(seq, "i")
    _one_line_naming_old(e.value, f"{SEQ_CHECKPOINT_KIND} file {seq}")


# -- session directory --------------------------------------------------------------------------------------------
def test_a_session_directory_of_another_version_is_refused(tmp_path):
    from crispedit.sessions.files import SESSION_FILE, SESSION_FORMAT, STATE_FILE, read_session_meta, read_session_state
    from crispedit.sessions.session import Session

    sess = tmp_path / "sess"
    sess.mkdir()
    (sess / SESSION_FILE).write_text(json.dumps({VERSION_KEY: OLD, "format": SESSION_FORMAT}))
    (sess / STATE_FILE).write_text(
        json.dumps({VERSION_KEY: OLD, "format": SESSION_FORMAT, "round": 0, "files": {}, "rounds": []})
    )
    for read in (lambda: read_session_meta(sess), lambda: Session.open(sess)):
        with pytest.raises(VersionError) as e:
            read()
        _one_line_naming_old(e.value, f"session {sess}")
        assert str(e.value).endswith("start a new session")
    with pytest.raises(VersionError) as e:
        read_session_state(sess)
    _one_line_naming_old(e.value, str(sess / STATE_FILE))


# -- curvature cache and eigenbases: a miss, rebuilt ----------------------------------------------------------------
def test_a_cache_entry_of_another_version_is_refused_as_a_file_and_rebuilt_as_an_entry(tiny_lm, tmp_path, caplog):
    from crispedit.curvature.cache import CurvatureSpec, get_or_build_factors, load_factors
    from crispedit.layers import resolve_layers
    from crispedit.weights import weight_fingerprint

    model, tok = tiny_lm
    layers = resolve_layers(model, "model.layers.1.mlp.down_proj")
    spec = CurvatureSpec(
        model_fingerprint=weight_fingerprint(model),
        layers=tuple(layers),
        corpus_digest="c" * 32,
        n_texts=2,
        max_len=32,
        label_mode="sampled",
        seed=0,
    )
    texts = ["one text here for the cache", "and another one"]
    _, info = get_or_build_factors(model, tok, layers, texts, spec, root=tmp_path, progress=False)
    path = Path(info["path"])
    _restamp(path, "crispedit")
    with pytest.raises(VersionError) as e:  # a file given by path (`edit --cache`, `cache info`): refused
        load_factors(path, spec)
    _one_line_naming_old(e.value, str(path))
    with caplog.at_level(logging.WARNING, logger="crispedit.curvature"):
        f, info = get_or_build_factors(model, tok, layers, texts, spec, root=tmp_path, progress=False)
    assert not info["hit"] and info["path"] == str(path) and f.n_tokens > 0
    logged = [r.getMessage() for r in caplog.records if r.name == "crispedit.curvature"]
    assert any(f"was written by crispedit {OLD}; this is crispedit {NOW}" in m and "rebuilding" in m for m in logged)
    assert load_factors(path, spec).meta[VERSION_KEY] == NOW  # replaced by this version's entry
    # the eigenbasis cache beside it: another version's file is decomposed again (logged), then rewritten
    from crispedit.curvature import eigen

    names = list(layers)
    f1 = load_factors(path, spec)
    eig = eigen.factor_eigh(f1, names, ("A",))
    epath = eigen.eigen_cache_path(f1)
    assert epath.is_file()
    _restamp(epath, "crispedit-eigh")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="crispedit.curvature"):
        again = eigen.factor_eigh(load_factors(path, spec), names, ("A",))
    assert any(f"eigenbasis cache {epath} was written by crispedit {OLD}" in r.getMessage() for r in caplog.records)
    assert all(torch.equal(again[k][1], eig[k][1]) for k in eig)
    assert eigen._load(epath, load_factors(path, spec)) != {}  # rewritten by this version


def test_a_converted_gguf_of_another_version_is_converted_again(tmp_path, caplog):
    from crispedit.models import _conversion_record, spec_gguf

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    d = tmp_path / "converted"
    d.mkdir()
    (d / "crispedit_source.json").write_text(json.dumps({VERSION_KEY: OLD, "gguf": str(gguf)}))
    with caplog.at_level(logging.WARNING, logger="crispedit.models"):
        assert _conversion_record(d) is None and spec_gguf(d) is None
    assert any(
        f"was written by crispedit {OLD}" in r.getMessage() and "converting the GGUF again" in r.getMessage()
        for r in caplog.records
    )
    (d / "crispedit_source.json").write_text(json.dumps(stamped({"gguf": str(gguf)})))
    assert spec_gguf(d) == gguf


# -- delta, MEND network, eval results ----------------------------------------------------------------------------
def test_a_delta_of_another_version_is_refused_torch_free_and_by_the_cli(tmp_path, capsys):
    from crispedit.cli import main
    from crispedit.delta_format import DELTA_FORMAT, DELTA_KIND, read_delta_header

    path = _crafted(
        tmp_path / "delta.safetensors",
        "crispedit_delta",
        {VERSION_KEY: OLD, "kind": DELTA_KIND, "format": DELTA_FORMAT},
    )
    with pytest.raises(VersionError) as e:
        read_delta_header(path)
    _one_line_naming_old(e.value, f"delta {path}")
    assert main(["delta", "info", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("crispedit: error: ") and f"crispedit {OLD}" in err


def test_a_mend_network_of_another_version_is_refused(tmp_path):
    from crispedit.methods.mend.net import FORMAT_VERSION, META_KEY, read_network_meta

    path = _crafted(tmp_path / "mend.safetensors", META_KEY, {VERSION_KEY: OLD, "format": FORMAT_VERSION})
    with pytest.raises(VersionError) as e:
        read_network_meta(path)
    _one_line_naming_old(e.value, str(path))
    assert "crispedit mend train" in str(e.value)


def test_an_eval_result_of_another_version_is_refused_by_report(tmp_path):
    from crispedit.evaluation.report import load_run

    path = tmp_path / "run.json"
    path.write_text(json.dumps({VERSION_KEY: OLD, "edit": {"rel": 0.5}, "capabilities": {}, "config": {}}))
    with pytest.raises(VersionError) as e:
        load_run(path)
    _one_line_naming_old(e.value, str(path))
    path.write_text(json.dumps(stamped({"edit": {"rel": 0.5}, "capabilities": {}, "config": {}})))
    assert load_run(path)["edit"]["rel"] == 0.5


def test_source_commit_names_a_checkouts_commit_and_its_changes_and_nothing_outside_git(tmp_path):
    """A run records the git commit of the crispedit source it ran (``+dirty`` when tracked files under the folder
    changed); outside any work tree there is none to name."""
    import shutil
    import subprocess

    from crispedit.versions import source_commit

    assert source_commit(tmp_path) is None
    if shutil.which("git") is None:
        pytest.skip("needs git")
    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True, text=True)  # noqa: E731
    git("init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git("rev-parse", "HEAD").stdout.strip()
    assert source_commit(repo) == head
    (repo / "a.py").write_text("x = 2\n")
    source_commit.cache_clear()  # asked once per process: the source does not change under a run
    assert source_commit(repo) == head + "+dirty"
    (repo / "a.py").write_text("x = 1\n")
    (repo / "new.py").write_text("y = 1\n")  # untracked files are not the source that ran
    source_commit.cache_clear()
    assert source_commit(repo) == head
