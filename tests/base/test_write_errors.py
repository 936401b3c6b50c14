"""A write the file system refuses midway (no space left, read-only, no permission) is one line naming the
destination and the cause, and leaves nothing half-written: the atomic writers of ``atomic.py`` for every
command, ``cli.main`` for an OSError from anywhere else. The failures are simulated (monkeypatched writers),
and once for real: a file-size limit makes the real safetensors writer fail in a subprocess."""

import errno
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from crispedit.atomic import (
    atomic_directory,
    atomic_file,
    atomic_save_safetensors,
    atomic_write_bytes,
    atomic_write_json,
)
from crispedit.cli import main
from crispedit.errors import CrispEditError, WriteError, os_error_line, write_failure

CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
}


def _oserror(code: int, filename=None) -> OSError:
    return OSError(code, os.strerror(code), *([str(filename)] if filename else []))


def _listing(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative name -> bytes): hidden temporaries included."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _full_disk(monkeypatch):
    """``os.statvfs`` of every directory reports no free block."""
    real = os.statvfs

    class Full:
        def __init__(self, st):
            self.f_frsize, self.f_bfree, self.f_bavail = st.f_frsize, 0, 0

    monkeypatch.setattr(os, "statvfs", lambda p: Full(real(p)))


@pytest.mark.parametrize("code", sorted(CAUSES))
@pytest.mark.parametrize("writer", ["bytes", "safetensors", "file", "directory"])
def test_atomic_writers_name_the_destination_and_the_cause(writer, code, tmp_path, monkeypatch):
    """Each atomic writer turns the OS's refusal into a WriteError (a CrispEditError and an OSError) whose one
    line names the final file, never the temporary one; the earlier file is kept as it was."""
    (tmp_path / "kept.txt").write_bytes(b"earlier")
    before = _listing(tmp_path)

    def refuse(*a, **k):
        raise _oserror(code)

    if writer == "bytes":
        monkeypatch.setattr(os, "fsync", refuse)
        dest = tmp_path / "kept.txt"
        call = lambda: atomic_write_bytes(dest, b"new")  # noqa: E731
    elif writer == "safetensors":
        import safetensors.torch
        from safetensors import SafetensorError

        def half(tensors, filename, metadata=None):
            Path(filename).write_bytes(b"half a file")
            raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")

        monkeypatch.setattr(safetensors.torch, "save_file", half)
        dest = tmp_path / "factors.safetensors"
        call = lambda: atomic_save_safetensors(dest, {"a": torch.zeros(3)})  # noqa: E731
    elif writer == "file":
        dest = tmp_path / "model.gguf"

        def call():
            with atomic_file(dest) as tmp:
                tmp.write_bytes(b"header")
                raise _oserror(code)
    else:
        dest = tmp_path / "out" / "edit_report.json"

        def call():
            with atomic_directory(tmp_path / "out") as tmp:
                (tmp / "model.safetensors").write_bytes(b"weights")
                monkeypatch.setattr(os, "fsync", refuse)
                atomic_write_json(tmp / "edit_report.json", {"x": 1})

    with pytest.raises(WriteError) as info:
        call()
    err = info.value
    assert isinstance(err, CrispEditError) and isinstance(err, OSError)
    assert str(err) == f"cannot write {dest}: {CAUSES[code]} (nothing was written)" and err.path == dest
    assert "\n" not in str(err) and ".tmp" not in str(err)
    assert _listing(tmp_path) == before


def test_the_directory_a_write_needs_cannot_be_made(tmp_path, monkeypatch):
    def refuse(self, *a, **k):
        raise _oserror(errno.EROFS, self)

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(WriteError, match=r"cannot write .*new/a\.json: read-only file system"):
        atomic_write_bytes(tmp_path / "new" / "a.json", b"x")
    with pytest.raises(WriteError, match=r"cannot write .*new/d: read-only file system"):
        with atomic_directory(tmp_path / "new" / "d"):
            pass
    assert not any(tmp_path.iterdir())


def test_a_short_write_without_a_code_is_no_space_on_a_full_disk(tmp_path, monkeypatch):
    """numpy's short write (what GGUF writers raise) carries no errno: a disk without free space says why."""

    def short():
        with atomic_file(tmp_path / "m.gguf") as tmp:
            tmp.write_bytes(b"part")
            raise OSError("10000 requested and 218 written")

    with pytest.raises(WriteError, match=r"m\.gguf: the write stopped short \(10000 requested and 218 written\)"):
        short()
    _full_disk(monkeypatch)
    with pytest.raises(WriteError, match=r"cannot write .*m\.gguf: no space left on device"):
        short()
    assert not any(tmp_path.iterdir())


def test_other_errors_pass_through_unchanged(tmp_path):
    """A bug, a user error, an OSError about a file the block read or one without any I/O cause are not
    write failures: they propagate as they were (and the temporary directory is gone)."""
    for exc in (
        ValueError("a bug"),
        CrispEditError("a user error"),
        OSError("not an I/O failure"),
        _oserror(errno.EACCES, "/elsewhere/config.json"),
    ):
        with pytest.raises(type(exc)) as info:
            with atomic_directory(tmp_path / "out"):
                raise exc
        assert info.value is exc
    assert not any(tmp_path.iterdir())
    assert write_failure(ValueError("x")) is None and write_failure(KeyboardInterrupt()) is None
    assert write_failure(Exception("No space left on device (os error 28)")) == "no space left on device"


def test_a_skipped_cache_write_still_skips(tmp_path, monkeypatch):
    """Callers that skip an unwritable file catch OSError; a WriteError is one."""
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(_oserror(errno.ENOSPC)))
    try:
        atomic_write_json(tmp_path / "x.json", {})
    except OSError as exc:
        assert "no space left on device" in str(exc)
    else:
        pytest.fail("no error")


def test_main_prints_an_oserror_from_elsewhere_as_one_line(monkeypatch, capsys):
    """An OSError that reaches cli.main outside the atomic writers: one line when it names a file or is a
    write refusal; any other OSError is a bug and keeps its traceback."""
    import crispedit.cli.delta as delta_cli

    for exc, line in (
        (_oserror(errno.ENOSPC), "no space left on device"),
        (_oserror(errno.EACCES, "/x/y.json"), "/x/y.json: permission denied"),
    ):
        monkeypatch.setattr(delta_cli, "cmd_info", lambda args, exc=exc: (_ for _ in ()).throw(exc))
        assert main(["delta", "info", "d.safetensors"]) == 2
        assert capsys.readouterr().err == f"crispedit: error: {line}\n"
    monkeypatch.setattr(delta_cli, "cmd_info", lambda args: (_ for _ in ()).throw(OSError("odd")))
    with pytest.raises(OSError, match="odd"):
        main(["delta", "info", "d.safetensors"])
    assert os_error_line(OSError("odd")) is None and os_error_line(_oserror(errno.ENOENT)) is None


# --- the commands ---------------------------------------------------------------------------------------------


def _run(args, capsys):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("crispedit: error: cannot write "), err
    assert "Traceback" not in err and ".tmp" not in err
    return lines[0]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_edit_on_a_full_disk(code, tiny_model_dir, tmp_path, iso_cache, capsys, monkeypatch):
    """`edit` trains, then the model's weights cannot be written: one line naming the output and the cause,
    exit 2, no output directory and no temporary one."""
    import transformers.modeling_utils as mu
    from safetensors import SafetensorError

    def refuse(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"the first bytes")
        if code == errno.EACCES:
            raise _oserror(code, filename)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(mu, "safe_save_file", refuse)
    edits = tmp_path / "edits.json"
    edits.write_text(json.dumps([{"src": "Who founded club 1?", "alt": "Founder B"}]))
    (tmp_path / "work").mkdir()
    status, _, err = _run(
        [
            "edit",
            "--model",
            tiny_model_dir,
            "--edits",
            edits,
            "--method",
            "ft",
            "--epochs",
            1,
            "--layers",
            "model.layers.1.mlp.down_proj",
            "--no-wild",
            "--out",
            tmp_path / "work" / "out",
            "--quiet",
        ],
        capsys,
    )
    line = _one_line(err)
    assert status == 2 and CAUSES[code] in line and str(tmp_path / "work" / "out") in line
    if code == errno.EACCES:  # the error named the file: so does the line
        assert "out/model.safetensors: permission denied" in line
    assert not any((tmp_path / "work").iterdir())


def test_cache_build_on_a_full_disk(tiny_model_dir, tmp_path, iso_cache, capsys, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    def half(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", half)
    out = tmp_path / "factors" / "factors.safetensors"
    status, _, err = _run(
        [
            "cache",
            "build",
            "--model",
            tiny_model_dir,
            "--layers",
            "model.layers.1.mlp.down_proj",
            "--n-cap",
            2,
            "--max-len",
            16,
            "--out",
            out,
            "--quiet",
        ],
        capsys,
    )
    line = _one_line(err)  # the first write is the cache's own entry, which --out then copies
    assert status == 2 and line.startswith(f"crispedit: error: cannot write {iso_cache / 'kfac'}/")
    assert line.endswith(".safetensors: no space left on device (nothing was written)")
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".tmp")]


def test_export_gguf_on_a_full_disk(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """The GGUF writer's short write carries no errno; the line still says there is no space."""
    import gguf

    def short(self, *a, **k):  # the header and the metadata are in the temporary file by now
        raise OSError("1048576 requested and 4096 written")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", short)
    _full_disk(monkeypatch)
    out = tmp_path / "m.gguf"
    out.write_bytes(b"an earlier export")
    status, _, err = _run(["export", "gguf", tiny_model_dir, "--out", out], capsys)
    assert (
        status == 2
        and _one_line(err) == f"crispedit: error: cannot write {out}: no space left on device (nothing was written)"
    )
    assert _listing(tmp_path) == {"m.gguf": b"an earlier export"}


def test_a_real_writer_past_its_file_size_limit(tiny_model_dir, tmp_path):
    """No simulation: `cache build` under a 4 KiB file-size limit, the real safetensors writer failing with the
    OS's own error (EFBIG, what a full disk's ENOSPC travels like)."""
    out = tmp_path / "c" / "factors.safetensors"
    (tmp_path / "c").mkdir()
    cache = tmp_path / "cache"

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an over-long write fails instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = dict(os.environ, CRISPEDIT_CACHE=str(cache))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "crispedit",
            "cache",
            "build",
            "--model",
            str(tiny_model_dir),
            "--layers",
            "model.layers.1.mlp.down_proj",
            "--n-cap",
            "2",
            "--max-len",
            "16",
            "--out",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=limit,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert line.startswith(f"crispedit: error: cannot write {cache / 'kfac'}/") and "\n" not in line
    assert line.endswith(".safetensors: file too large (nothing was written)")
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".tmp")]
