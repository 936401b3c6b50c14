"""benchmarks/bench_kfac.py on a minute model: the report, the factor check against kronfluence (when it is
installed) and the clear skip when it is not. No timing is asserted (the machines are shared)."""

import json
import sys

import pytest

from conftest import REPO, load_script

BENCH = REPO / "benchmarks" / "bench_kfac.py"
SMALL = [
    "--tiny",
    "--tiny-blocks",
    "2",
    "--layers",
    "model.layers.{0-1}.mlp.down_proj",
    "--n",
    "3",
    "--max-len",
    "12",
    "--batch",
    "2",
    "--repeats",
    "1",
    "--threads",
    "1",
]


@pytest.fixture()
def bench():
    return load_script(BENCH, "bench_kfac")


def run(bench, monkeypatch, capsys, *extra):
    monkeypatch.setattr(sys, "argv", ["bench_kfac.py", *SMALL, *extra])
    bench.main()
    out = capsys.readouterr()
    return out.out, out.err, json.loads(out.out.strip().splitlines()[-1])


def test_bench_skips_kronfluence_with_a_message_when_it_is_missing(bench, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "kronfluence", None)  # import kronfluence -> ImportError
    assert "ModuleNotFoundError" in bench.kronfluence_available()
    out, err, summary = run(bench, monkeypatch, capsys)
    assert "kronfluence skipped (ModuleNotFoundError" in err and "pip install --no-deps kronfluence==1.0.1" in err
    assert "throughput ratio ours/bare" in out and "kronfluence[" not in out
    assert summary["tokens"] > 0 and set(summary["seconds"]) == {"ours", "bare"}


def test_bench_factors_agree_with_kronfluence(bench, monkeypatch, capsys):
    pytest.importorskip("kronfluence")
    out, _, summary = run(bench, monkeypatch, capsys, "--kf-feed", "analyzer,ours")
    assert set(summary["factor_rel_diff"]) == {"analyzer", "ours"}
    assert all(r <= 1e-5 for r in summary["factor_rel_diff"].values())
    assert "ours/kronfluence[analyzer]" in out and "ours/kronfluence[ours]" in out
