"""Stored figures are what the code and the data give: results/README.md and the README's generated blocks
against ``results/make.py``, and (slow, in CI) the demo's printed table against its stored output."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO, load_script

make = load_script("results/make.py", "results_make")  # puts results/ on sys.path: its sections import
from results_sections import demo_run, keep_term, seq_streams, speed  # noqa: E402


def test_summary_page_and_readme_blocks_are_what_the_data_gives():
    """``python results/make.py --check``: results/README.md and every README block regenerate unchanged."""
    assert make.main(["--check"]) == 0, "run: python results/make.py"


def test_make_runs_as_a_script():
    """``python results/make.py`` calls ``main``: an unknown flag is refused by its parser (exit 2), where a file
    with no script entry would exit 0 having done nothing."""
    done = subprocess.run([sys.executable, "results/make.py", "--bogus"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and "--bogus" in done.stderr


def test_readme_demo_block_is_the_stored_demo_output():
    """The README's demo block is the table part of results/demo/demo.txt, character for character."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- results:demo -->\n```\n(.*?)```\n<!-- /results:demo -->", readme, re.S)
    assert block, "README.md has no demo block"
    assert block.group(1) == demo_run.demo_table((REPO / "results" / "demo" / "demo.txt").read_text())


def test_make_demo_runs_the_stored_command():
    """``make demo`` runs results/demo/command.sh, the command whose output demo.txt stores (and the slow test
    reruns), so the README's table is what ``make demo`` prints."""
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
    assert recipe and "results/demo/command.sh" in recipe.group(1)
    assert demo_run.demo_command()[:2] == ["crispedit", "demo"]


def test_mask_timings_hides_seconds_only():
    """Timings are masked — the ``[ N s]`` prefixes, ``N s`` anywhere, the ``edit s`` column — and nothing else."""
    text = (
        "[  123 s] crispedit: edited in 83 s (25 epochs)\n"
        "method      qa  kl_drift epochs  edit s  contexts\n"
        "crispedit 1.00/1.00 0.00227 25    83.4  bare,chat\n"
        "ft        1.00/0.83 0.02503 20   155.3  bare,chat\n\n"
        "base perplexity 38.959 total 227s\n"
    )
    masked = demo_run.mask_timings(text)
    for gone in ("83.4", "155.3", "227s", "123 s", "83 s"):
        assert gone not in masked
    for kept in ("1.00/1.00", "0.00227", "0.02503", "38.959", "25", "20", "bare,chat"):
        assert kept in masked
    assert demo_run.mask_timings(text.replace("83.4", "91.0").replace("227s", "301s")) == masked
    # another machine's seconds may have another number of digits: the masked column is the same
    assert demo_run.mask_timings(text.replace("  155.3", "   95.3").replace("   83.4", "  183.4")) == masked


def test_compare_demo_tables_tolerates_last_digits_not_answers():
    """Continuous figures may differ in their last digits (another CPU's float32 kernels); rates, answers and
    epochs may not."""
    stored = "crispedit 1.00/1.00 0.00227 39.10 x1.02 25\nPerl | Perl\n"
    assert demo_run.compare_demo_tables(stored, stored.replace("0.00227", "0.00228").replace("39.10", "39.12")) == []
    for changed in (
        stored.replace("1.00/1.00", "1.00/0.83"),
        stored.replace("0.00227", "0.00300"),
        stored.replace(" 25", " 26"),
        stored.replace("Perl | Perl", "Perl | C"),
    ):
        assert demo_run.compare_demo_tables(stored, changed)


def test_compare_demo_tables_lets_one_near_tie_answer_flip_not_two():
    """Another CPU may turn one greedy answer of the six edits the other way: one rate moving by one edit's share is
    tolerated, a second such move (or a move of two shares, or any move without the edit table) is not."""
    table = "question | new target | crispedit\n" + "-" * 40 + "\n" + "".join(f"q{i} | t{i} | t{i}\n" for i in range(6))
    row = "crispedit    1.00/0.67   1.00/0.33   1.00/0.50   1.000   0.00242\n"
    stored = table + "\n" + row
    one = stored.replace("1.00/0.33", "1.00/0.50")
    assert demo_run.compare_demo_tables(stored, one) == []
    assert demo_run.compare_demo_tables(stored, one.replace("1.00/0.67", "1.00/0.83"))
    assert demo_run.compare_demo_tables(stored, stored.replace("1.00/0.33", "1.00/0.67"))
    assert demo_run.compare_demo_tables(row, row.replace("1.00/0.33", "1.00/0.50"))
    assert demo_run.compare_demo_tables(stored, stored.replace("| t0\n", "| u0\n"))


@pytest.mark.slow
@pytest.mark.ci
def test_demo_prints_the_stored_table(tmp_path):
    """``make demo``'s command prints the table stored in results/demo/demo.txt (and so in the README), timings
    aside. On a change to what the demo prints, rerun it: ``python results/make.py --demo``."""
    cmd = demo_run.demo_command()
    assert cmd[0] == "crispedit"
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-m", "crispedit", *cmd[1:]], cwd=REPO, capture_output=True, text=True, env=env, timeout=3600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    stored = demo_run.demo_table((REPO / "results" / "demo" / "demo.txt").read_text())
    diffs = demo_run.compare_demo_tables(stored, demo_run.demo_table(proc.stdout))
    assert not diffs, (
        f"`{shlex.join(cmd)}` no longer prints the stored table (results/demo/demo.txt); if the change "
        "is meant, run python results/make.py --demo:\n" + "\n".join(diffs)
    )


def test_before_after_rows_name_what_each_row_trained_with():
    """A fine-tuning row of a before/after run is labelled from its own config (term, answer end) with its epochs; a
    closed-form row, which trains neither, by its run's file and without epochs."""
    ft = {"method": "ft", "config": {"keep_chat": 0, "keep_subject": 0, "answer_end": "period"}}
    crisp = {"method": "crispedit", "config": {"keep_chat": 75, "keep_subject": 4, "answer_end": "auto"}}
    alpha = {"method": "alphaedit", "config": {"keep_chat": 0}, "training": {"single_pass": True, "epochs": 0}}
    assert keep_term._row_settings(ft, "after.json") == "no term, the period answer end"
    assert keep_term._row_settings(crisp, "before.json") == "the term, the chat turn's end"
    assert keep_term._row_settings(alpha, "after.json") == "closed form (after.json)"
    assert keep_term._trains(crisp) and not keep_term._trains(alpha)


def test_pilot_table_reads_each_round_on_the_final_model(tmp_path):
    """A pilot stream's row: round 1's edits right after round 1 and after the last round, every round's QA-wrapper
    reach on the final model from the per-edit verdicts (rounds are consecutive slices of ``seq_chunk`` edits), the
    kept directions of the first and last round."""
    import json

    verdicts = [True] * 4 + [True, False, False, False]  # round 1: 4 of 4, round 2: 1 of 4
    row = {
        "seq_chunk": 4,
        "retention": [
            {"tf_rel": 1.0, "wild": {"qa": 1.0, "chat": 1.0}},
            {"tf_rel": 1.0, "wild": {"qa": 0.75, "chat": 1.0}},
        ],
        "wild": {w: {"rel": 0.625, "answers": [["x", v, [], []] for v in verdicts]} for w in ("qa", "chat", "none")},
        "tf": {"rel": [1.0] * 8},
        "round_records": [{"projector_kept": {"a": 0.8, "b": 0.6}}, {"projector_kept": {"a": 0.4, "b": 0.2}}],
        "summary": {"kl_drift": 0.0123},
        "edit_seconds": 7200.0,
    }
    (tmp_path / "full95.json").write_text(json.dumps({"results": {"crispedit-seq": row}}))
    (tmp_path / "run.json").write_text(json.dumps({"command": "crispedit compare ..."}))
    line = seq_streams.seq_pilot_table(tmp_path).splitlines()[-1]
    assert "| 1.00 / 1.00 / 1.00 | 1.00 / 0.75 / 1.00 | 1.00 · 0.25 | 0.62 / 0.62 / 0.62 |" in line
    assert "| 0.70 → 0.30 | 0.0123 | 2.00 | 1 **not met**, 2 **not met** |" in line
    assert "picks" not in seq_streams.seq_pilot_table(tmp_path)  # one setting: nothing chosen
    other = dict(row, config={"edit_gamma": 0.8}, wild={**row["wild"], "qa": {**row["wild"]["qa"], "rel": 0.9}})
    (tmp_path / "full80.json").write_text(json.dumps({"results": {"crispedit-seq": other}}))
    pick, paired = seq_streams.seq_pilot_table(tmp_path).splitlines()[-2:]
    assert pick == (
        "The rule picks `full80` (edit γ 0.8). It meets as many of the checks (0 of 2) as `full95`, and reaches "
        "further over all edits: a mean of 0.72 under the QA wrapper, chat and no wrapper, against 0.62 (`full95`)."
    )
    assert paired == (
        "Paired over the 4 edits after round 1 (QA wrapper, final model), the edits that hold only under `full80` and "
        "only under the other setting: against `full95`, 0 and 0 (exact sign test p = 1)."
    )
    fresh = dict(other, config={"edit_gamma": 0.8, "edit_factors": "target", "carry_optimizer": False, "replay": 50})
    fresh["config"]["weighting"] = "apart"
    fresh["wild"] = {**other["wild"], "qa": {**other["wild"]["qa"], "rel": 0.95}}
    fresh["wild"]["qa"]["answers"] = [["x", v, [], []] for v in [True] * 4 + [True, True, True, False]]
    (tmp_path / "fresh80.json").write_text(json.dumps({"results": {"crispedit-seq": fresh}}))
    pick, paired = seq_streams.seq_pilot_table(tmp_path).splitlines()[-2:]
    assert pick.startswith(
        "The rule picks `fresh80` (edit γ 0.8, weighting apart, edit factors at the target positions, a fresh Adam "
        "each round, 50 earlier edits replayed each round). It meets as many of the checks (0 of 2) as `full80`, "
        "`full95`,"
    )
    assert paired.endswith(  # round 2: 3 of 4 against 1 of 4 in both others
        "against `full80`, 2 and 0 (exact sign test p = 0.5); against `full95`, 2 and 0 (exact sign test p = 0.5)."
    )
    assert seq_streams.seq_pilot_table(tmp_path / "none") == ""


def test_pilot_checks_read_the_rule_from_the_row():
    """Check 1 holds when every later round's own QA reach on the final model is within 0.05 of round 1's right after
    it; check 2 when round 1's TF, QA and chat reach after the last round are each at least 0.9 of right after it."""
    verdicts = [True] * 20 + [True] * 19 + [False]  # round 1: 20 of 20; round 2: 0.95 on the final model
    row = {
        "seq_chunk": 20,
        "retention": [
            {"tf_rel": 1.0, "wild": {"qa": 1.0, "chat": 1.0}},
            {"tf_rel": 1.0, "wild": {"qa": 0.9, "chat": 0.89}},
        ],
        "wild": {"qa": {"answers": [["x", v, [], []] for v in verdicts]}},
    }
    assert seq_streams.pilot_checks(row) == (1, "1 met, 2 **not met**")
    row["retention"][1]["wild"]["chat"] = 0.9
    assert seq_streams.pilot_checks(row) == (2, "1 met, 2 met")


def _pilot_row(later_qa_right: int, chat_after: float, reach: float) -> dict:
    """A two-round pilot row of 20 edits a round: round 2's edits ``later_qa_right`` of 20 right under the QA wrapper
    on the final model, round 1's chat reach ``chat_after`` after the last round, ``reach`` under every wrapper."""
    verdicts = [True] * 20 + [True] * later_qa_right + [False] * (20 - later_qa_right)
    return {
        "seq_chunk": 20,
        "retention": [
            {"tf_rel": 1.0, "wild": {"qa": 1.0, "chat": 1.0}},
            {"tf_rel": 1.0, "wild": {"qa": 0.95, "chat": chat_after}},
        ],
        "wild": {w: {"rel": reach, "answers": [["x", v, [], []] for v in verdicts]} for w in ("qa", "chat", "none")},
    }


def test_pilot_choice_takes_more_checks_then_more_reach():
    """The setting meeting more checks wins whatever its reach; between settings meeting as many, the higher mean
    all-edit reach; one setting alone is no choice."""
    both = _pilot_row(20, 1.0, 0.70)  # checks 1 and 2
    one = _pilot_row(10, 1.0, 0.90)  # check 2 only (round 2 lands 0.5)
    other = _pilot_row(20, 0.5, 0.80)  # check 1 only (round 1's chat falls to 0.5)
    assert (
        seq_streams.pilot_checks(both)[0] == 2
        and seq_streams.pilot_checks(one)[0] == 1
        and seq_streams.pilot_checks(other)[0] == 1
    )
    assert seq_streams.pilot_choice({"a": one, "b": both}) == "b"
    assert seq_streams.pilot_choice({"a": one, "b": other}) == "a"
    assert seq_streams.pilot_choice({"a": other, "b": one}) == "b"
    assert seq_streams.pilot_choice({"a": both}) is None
    assert (
        seq_streams._pick_reason({"a": one, "b": both}, "b")
        == "It meets more of the checks (2 of 2) than every other setting."
    )


def test_landed_table_puts_what_each_round_landed_beside_what_the_final_model_holds():
    """Per wrapper, a line of each round's edits right after their round (the probes' ``newest``) and one on the final
    model (the per-edit verdicts); nothing for a row whose probes did not measure the former."""
    first = {"n": 2, "tf_rel": 1.0, "wild": {"qa": 1.0, "chat": 1.0}}
    second = {"n": 2, "tf_rel": 1.0, "wild": {"qa": 0.5, "chat": 1.0}}
    row = {
        "seq_chunk": 2,
        "retention": [dict(first, newest=first), dict(first, newest=second)],
        "tf": {"rel": [1, 1, 1, 1]},
        "wild": {w: {"answers": [["x", v, [], []] for v in (True, False, False, False)]} for w in ("qa", "chat")},
    }
    table = seq_streams.landed_table(row)
    assert "| WILD qa, right after their round | 1.00 | 0.50 |" in table
    assert "| WILD qa, on the final model | 0.50 | 0.00 |" in table
    assert "| WILD chat, right after their round | 1.00 | 1.00 |" in table
    assert seq_streams.landed_table({"retention": [first], "seq_chunk": 2}) == ""


def _stream_round(k: int, wall: float, stalled: bool = False) -> dict:
    phases = {p: 1.0 for p in speed.LATENCY_PHASES} | {"evaluate": float(k)}
    return {
        "round": k,
        "wall": wall,
        "phases": {**phases, "total": 6.0},
        "steps": 2 * k,
        "kl_drift": 0.001 * k,
        "stalled": stalled,
    }


def test_stream_section_reads_the_calls_the_first_edits_and_the_final_model(tmp_path):
    """A stored single-edit stream: the calls' median, mean and slowest (a stalled round left out), the first and last
    tenth's means (the calls', the evaluate phase's, the steps'), the rest of a call beyond its record's phases, the
    first edits' rel after the shown rounds with their mean and the KL drift, and the final model's rows; nothing
    while none is stored."""
    import json

    rounds = [_stream_round(k, 10.0 + k) for k in range(1, 21)]
    rounds[4] = _stream_round(5, 500.0, stalled=True)
    retention = [[1.0] * min(k, 2) for k in range(1, 21)]
    retention[-1] = [0.5, 1.0]
    summary = {
        "n_edits": 2,
        "tf_rel": 1.0,
        **{f"wild_{w}_rel": 0.5 for w in ("qa", "chat", "none")},
        "style_length_ratio": 0.9,
        "bleed_target": 0.0,
        "kl_drift": 0.02,
        "ppl": 40.0,
        "ppl_base": 39.0,
    }
    stream = {
        "edits": "../shared/data/edits/zsre_dev.json:1000:20",
        "rounds": rounds,
        "stalled_rounds": [5],
        "retention_first": retention,
        "final": {"first": {"summary": summary}, "all": {"summary": {**summary, "n_edits": 20}}},
    }
    (tmp_path / "stream.json").write_text(json.dumps(stream))
    (tmp_path / "run.json").write_text(json.dumps({"command": "python benchmarks/session_stream.py ..."}))
    text = speed.stream_section(tmp_path)
    assert "zsre_dev.json\n1000–1019" in text and "1 stopped or starved rounds counted apart" in text
    assert "A call took 21.0 s in the median (20.8 s mean, slowest\n30.0 s) over 19 rounds" in text
    assert "the first 2 rounds 11.5 s on average, the last 2 29.5 s" in text
    assert "took 14.8 s more" in text
    assert "evaluate took\n1.5 and 19.5 s in the first and the last 2 rounds" in text  # the stalled round left out
    assert "3.0 and 39.0 steps" in text
    assert "| 10 | 1.00 | 1.00 | 1.00 | 0.01 |" in text and "| 20 | 0.50 | 1.00 | 0.75 | 0.02 |" in text
    assert "| the first 2 | 2 | 0.50 / 0.50 / 0.50 | 1.00 | ×0.90 | 0.000 | 0.02 | 40.00 (39.00) |" in text
    assert speed.stream_section(tmp_path / "none") == ""


def test_one_edit_settings_table_puts_each_setting_beside_the_default(tmp_path, monkeypatch):
    """A row per stored setting run, its KL drift also as a ratio to the default's, steps summed over its rounds;
    nothing while the default's run is not stored."""
    import json

    def run(kl: float, steps: int) -> dict:
        summary = {f"wild_{w}_{k}": 1.0 for w in ("qa", "chat", "none") for k in ("rel", "gen")}
        summary.update(n_edits=2, kl_drift=kl, bleed_target=0.5, style_length_ratio=0.9)
        return {
            "edits": "../x/zsre_dev.json:400:2",
            "rounds": [{"steps": steps}, {"steps": steps}],
            "mean": {"wall": 12.0},
            "final": {"summary": summary},
        }

    monkeypatch.setattr(speed, "LATENCY", tmp_path)
    assert speed.one_edit_settings_table() == ""
    (tmp_path / "projection_gradient.json").write_text(json.dumps(run(0.004, 10)))
    (tmp_path / "lr_2e-4.json").write_text(json.dumps(run(0.002, 30)))
    text = speed.one_edit_settings_table()
    assert "The same 2 one-edit rounds (`zsre_dev.json:400:2`" in text
    assert "| 0.004 (×1.00) | 1.00 / 1.00 / 1.00, 1.00 / 1.00 / 1.00 | 0.50 | ×0.90 | 20 | 12.0 |" in text
    assert "lr_2e-4.json) | 0.002 (×0.50) |" in text and "| 60 | 12.0 |" in text


def test_confirm_section_reads_each_row_as_it_is_stored(tmp_path):
    """The confirming stream's rows are separate compare runs stored as they finish: the section shows what is stored,
    reads the marks once batch crispedit and crispedit-seq are both there, gives a sequential row whose retention
    records hold every round its retention map, and refuses files that edited different requests."""
    import json

    results = REPO / "results"
    rows = json.loads((results / "compare_zsre_dev1000" / "compare.json").read_text())["results"]
    rows["crispedit-seq"] = json.loads((results / "seq_pilot_zsre_dev200" / "full80.json").read_text())["results"][
        "crispedit-seq"
    ]
    same = {k: rows["crispedit-seq"]["config"]["edit"][k] for k in seq_streams.SEQ_MATCH}
    rows["crispedit"] = dict(rows["crispedit"], config={**rows["crispedit"]["config"], **same})

    def store(name: str, method: str, digest: str = "same") -> None:
        payload = {"settings": {"requests_digest": digest}, "results": {method: rows[method]}}
        (tmp_path / f"{name}.json").write_text(json.dumps(payload))

    assert seq_streams.seq_confirm_section(tmp_path) == ""
    store("ft-seq", "ft-seq")  # its retention records predate the per-round numbers: no map
    text = seq_streams.seq_confirm_section(tmp_path)
    assert "| ft-seq ([`ft-seq.json`]" in text and "batch crispedit ([" not in text
    assert "marks are read once batch crispedit and crispedit-seq are stored" in text
    assert "retention map" not in text
    store("batch", "crispedit")
    store("crispedit-seq", "crispedit-seq")
    text = seq_streams.seq_confirm_section(tmp_path)
    assert "| batch crispedit ([`batch.json`]" in text and "| crispedit-seq ([`crispedit-seq.json`]" in text
    assert "The sequential mode's marks, crispedit-seq against batch crispedit:" in text
    assert "| WILD qa rel within 0.05 of batch's |" in text
    assert "crispedit-seq's retention map" in text and "| after round | 1 | 2 |" in text
    assert set(seq_streams.confirm_payload(tmp_path)["results"]) == {"ft-seq", "crispedit-seq"}
    store("ft-seq", "ft-seq", digest="other")
    with pytest.raises(SystemExit, match="edit different requests"):
        seq_streams.seq_confirm_section(tmp_path)


def test_a_long_stream_shows_round_one_and_every_fifth_round():
    """Up to twelve rounds a stream's tables show every round; a thirty-round stream shows round 1, every fifth round
    and the last, in both the retention map and the landed table, each cell the value of the round it names."""
    assert seq_streams.shown_rounds(10) == list(range(10))
    assert seq_streams.shown_rounds(30) == [0, 4, 9, 14, 19, 24, 29]
    assert seq_streams.shown_rounds(13) == [0, 4, 9, 12]
    n = 30
    retention = [
        {
            "n": 100 * (j + 1),
            "tf_rel": 1.0,
            "wild": {"qa": 1.0, "chat": 1.0},
            "by_round": [round(1.0 - 0.01 * (j - k), 2) for k in range(j + 1)],
            "newest": {"n": 100, "tf_rel": 1.0, "wild": {"qa": round(0.5 + j / 100, 2), "chat": 1.0}},
        }
        for j in range(n)
    ]
    row = {"seq_chunk": 1, "retention": retention, "tf": {"rel": [1] * n}}
    table = seq_streams.retention_map_table(row)
    assert table.splitlines()[0] == "| after round | 1 | 5 | 10 | 15 | 20 | 25 | 30 |"
    assert len(table.splitlines()) == 2 + 7
    assert "| 30 | 0.71 | 0.75 | 0.80 | 0.85 | 0.90 | 0.95 | 1.00 |" in table
    assert "| 5 | 0.96 | 1.00 |  |  |  |  |  |" in table
    landed = seq_streams.landed_table(row)
    assert "| WILD qa, right after their round | 0.50 | 0.54 | 0.59 | 0.64 | 0.69 | 0.74 | 0.79 |" in landed


def test_the_counterfact_stream_reads_like_the_confirming_one(tmp_path):
    """The paper's-scale stream is the same section over its own directory: its title and cap, and the batch row's
    hours beside the sequential rows'."""
    import json

    rows = json.loads((REPO / "results" / "compare_counterfact_dev1000" / "compare.json").read_text())["results"]
    payload = {"settings": {"requests_digest": "d"}, "results": {"crispedit": rows["crispedit"]}}
    (tmp_path / "batch.json").write_text(json.dumps(payload))
    text = seq_streams.seq_counterfact_section(tmp_path)
    assert text.startswith("## Sequential editing at the paper's scale: CounterFact")
    assert "`--epochs 25`" in text
    hours = f"{rows['crispedit']['edit_seconds'] / 3600:.2f} |"
    assert next(line for line in text.splitlines() if line.startswith("| batch crispedit")).endswith(hours)
    assert "marks are read once crispedit-seq is stored" in text


def test_pilot_alone_table_reads_a_round_against_its_edits_alone(tmp_path):
    """Batch crispedit on one pilot round's edits alone sits beside what each pilot stream's round holding the same
    edits landed right after it and read on the final model; edits that are not one round of a stream are refused."""
    import json
    import shutil

    pilot = REPO / "results" / "seq_pilot_zsre_dev200"
    for name in ("full80.json", "full95.json"):
        shutil.copy(pilot / name, tmp_path / name)
    assert seq_streams.pilot_alone_table(tmp_path) == ""
    (tmp_path / "alone").mkdir()
    row = {"wild": {w: {"rel": r} for w, r in zip(("qa", "chat", "none"), (0.7, 1.0, 0.99))}, "summary": {"rel": 1.0}}
    edits = {"file": "../shared/data/edits/zsre_dev.json", "offset": 300, "n": 100}
    (tmp_path / "alone" / "run.json").write_text(json.dumps({"command": "crispedit compare ..."}))
    alone = tmp_path / "alone" / "dev300.json"
    alone.write_text(json.dumps({"settings": {"edits": edits}, "results": {"crispedit": row}}))
    table = seq_streams.pilot_alone_table(tmp_path).splitlines()
    line = table[2]
    assert line.startswith("| [zsre_dev.json 300–399](")
    assert table[-1].startswith("Edits 300–399 read the QA wrapper within 0.05 of alone as a later round")
    assert line.endswith("| 0.70 / 1.00 / 0.99 | 1.00 | round 2: 0.73 / 0.73 | round 2: – / 0.68 |")  # full95: no probe
    alone.write_text(json.dumps({"settings": {"edits": dict(edits, offset=350)}, "results": {"crispedit": row}}))
    with pytest.raises(SystemExit, match="not one round of the pilot stream full80"):
        seq_streams.pilot_alone_table(tmp_path)


def test_fast_line_reads_the_fast_rounds_against_the_default():
    """The sentence on the fastest one-edit setting quotes its round time against the target and the default's, and
    its chat length, bare share and drift against the default's; nothing while either run is missing."""
    summary = {f"wild_{w}_rel": 1.0 for w in ("qa", "chat", "none")}
    default = {
        "mean": {"wall": 80.0},
        "final": {"summary": dict(summary, style_length_ratio=0.9, style_bare_share=0.0, kl_drift=0.004)},
    }
    fast = {
        "mean": {"wall": 20.0, "train": 14.0},
        "target": 10.0,
        "final": {"summary": dict(summary, style_length_ratio=0.4, style_bare_share=0.5, kl_drift=0.01)},
    }
    line = speed._fast_line({"projection_gradient.json": default, "fast_no_keep.json": fast})
    assert "20.0 s a round (2.0× the 10 s target; training 14.0 s, the rest 6.0 s) against 80.0 s" in line
    assert "×0.40 the base's length, 0.50 of them bare (the default: ×0.90, 0.00) and the KL drift is ×2.50" in line
    assert speed._fast_line({"projection_gradient.json": default}) == ""


def test_run_line_names_the_commits_the_stored_files_record(tmp_path):
    """Beside run.json's hand-written commit, the run line names the commits the stored files record themselves
    (rows and rounds, ``+dirty`` kept), with the files holding each; a file written before that records none."""
    from results_sections.common import recorded_sources, run_line

    (tmp_path / "run.json").write_text(json.dumps({"commit": "abc1234", "command": ["crispedit compare"]}))
    row = lambda src: {"environment": {"source": src, "threads": 2}}  # noqa: E731
    two = {
        "results": {
            "base": row("abc1234" + "0" * 33),
            "seq": {**row("abc1234" + "0" * 33), "round_records": [row("def5678" + "1" * 33 + "+dirty")]},
        }
    }
    (tmp_path / "a.json").write_text(json.dumps(two))
    (tmp_path / "old.json").write_text(json.dumps({"results": {"base": {"summary": {}}}}))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.json").write_text(json.dumps(row("9999999" + "2" * 33)))  # another folder's run
    assert recorded_sources(tmp_path) == {"abc1234": ["a.json"], "def5678+dirty": ["a.json"]}
    line = run_line(tmp_path)
    assert "Stored in `abc1234`." in line
    assert "record the crispedit source that ran them: `abc1234` (a.json); `def5678+dirty` (a.json)." in line
    assert recorded_sources(tmp_path / "sub" / "nothing") == {}


def test_sign_test_is_the_exact_two_sided_binomial():
    """Discordant pairs split 8 to 1: p = 2 (1 + 9) / 2^9; an even split or none: 1; one-sided tail doubled."""
    assert seq_streams.sign_test(8, 1) == seq_streams.sign_test(1, 8) == 2 * 10 / 512
    assert seq_streams.sign_test(0, 0) == seq_streams.sign_test(5, 5) == 1.0
    assert seq_streams.sign_test(6, 0) == 2 / 64


def test_gradient_share_part_tables_each_constraint_and_reads_the_edit_gamma_off(tmp_path):
    """One row per round and constraint (the capability once, each setting with its mix), a column per wrapper; the
    sentence appears only when a low and a high edit γ at the default mix keep the same share, below the
    capability's."""
    from pathlib import Path

    def run(name, mix, shares):
        d = {"edits": {"file": "zsre_dev.json", "offset": 200, "n": 200}, "chunk": 100, "config": {"mix": mix}}
        d["gradient_share"] = {"2": {"qa": {"capability": 0.53, **shares}, "none": {"capability": 0.4, **shares}}}
        return Path(tmp_path / name), d

    files = [run("a.json", 0.5, {"full@0.8": 0.36}), run("b.json", 0.5, {"full@0.05": 0.363})]
    text = seq_streams.gradient_share_part(files)
    assert "| 2 | [capability](seq_room/a.json) | 0.530 | 0.400 |" in text
    assert "| 2 | [full@0.05, mix 0.5](seq_room/b.json) | 0.363 | 0.363 |" in text
    assert text.count("[capability]") == 1
    assert "keep 0.36 of their QA-wrapper gradient at edit γ 0.05 and 0.36 at 0.8, against 0.53" in text
    files[1] = run("b.json", 0.5, {"full@0.05": 0.45})  # the earlier edits' mask does cost room: no such reading
    assert "merged eigenbasis" not in seq_streams.gradient_share_part(files)
    assert seq_streams.gradient_share_part([]) == ""


def test_equal_room_reading_pairs_each_with_apart_rows_of_its_room():
    """Every apart row keeping the room ``each`` keeps (within 0.02) is read beside it: what a step spends of the
    earlier edits' curvature under each; nothing when each's edit γs keep different rooms."""
    each = {
        "full@0.8, mix 0.5": (0.360, {"edits": 0.0021}, None),
        "full@0.5, mix 0.5": (0.363, {"edits": 0.0022}, None),
    }
    rows = dict(each)
    rows["target@0.95, apart, 2 sweeps"] = (0.363, {"edits": 0.0072}, None)
    rows["target@0.8, apart, 2 sweeps"] = (0.446, {"edits": 0.0109}, None)  # more room: not paired
    assert seq_streams._equal_room_reading(each, rows) == [
        "At the room `each` keeps (0.36), apart (2 sweeps) with the edit factors at the target positions (edit γ 0.95) "
        "keeps 0.36 and a step spends 0.0072 of the earlier edits' curvature, against 0.0021–0.0022 under `each`."
    ]
    each["full@0.5, mix 0.5"] = (0.40, {"edits": 0.0022}, None)
    assert seq_streams._equal_room_reading(each, rows) == []


def test_room_exposure_table_names_each_weighting_and_reads_the_trade_off(tmp_path):
    """Settings keyed by ``seq_room.py`` become labels (the mix only where it acts); a run with ``exposure`` adds a
    table of the curvature a step costs, the sentence on ``each``'s edit γ when it moves neither side, and the
    ``apart`` trade-off at the sweep count measured at the most edit γs, beside the capability alone."""
    from pathlib import Path

    assert seq_streams.constraint_label("full@0.8", 0.5) == "full@0.8, mix 0.5"
    assert seq_streams.constraint_label("full@0.8:apart1", 0.5) == "full@0.8, apart, 1 sweep"
    assert seq_streams.constraint_label("target@0.5:apart2", 0.5) == "target@0.5, apart, 2 sweeps"
    assert seq_streams.constraint_label("full@0.5:trace", 0.1) == "full@0.5, trace, mix 0.1"
    cost = {
        "capability": {"capability": 0.013, "edits": 0.0235},
        "full@0.8": {"capability": 0.0095, "edits": 0.0021},
        "full@0.5": {"capability": 0.0096, "edits": 0.0022},
        "full@0.8:apart2": {"capability": 0.0074, "edits": 0.0024},
        "full@0.5:apart2": {"capability": 0.0109, "edits": 0.0071},
        "full@0.8:apart4": {"capability": 0.0069, "edits": 0.002},
    }
    share = {"capability": 0.53, "full@0.8": 0.36, "full@0.5": 0.363, "full@0.8:apart2": 0.326}
    share |= {"full@0.5:apart2": 0.451, "full@0.8:apart4": 0.31}
    run = {"edits": {"file": "zsre_dev.json", "offset": 200, "n": 200}, "chunk": 100, "config": {"mix": 0.5}}
    run |= {"gradient_share": {"2": {"qa": share}}, "exposure": {"2": cost}}
    text = seq_streams.gradient_share_part([(Path(tmp_path / "a.json"), run)])
    assert "| 2 | [full@0.5, apart, 2 sweeps](seq_room/a.json) | 0.451 | 0.0109 | 0.0071 |" in text
    assert "| 2 | [full@0.8, apart, 4 sweeps](seq_room/a.json) | 0.310 |" in text
    assert "from 0.5 to 0.8, round 2 keeps 0.36 of its QA gradient and a step spends 0.0021–0.0022" in text
    assert (
        "Masked apart (2 sweeps), the edit γ trades one for the other (room kept / earlier edits' curvature): "
        "edit γ 0.8: 0.33 / 0.0024; edit γ 0.5: 0.45 / 0.0071; the capability constraint alone 0.53 / 0.0235." in text
    )
    cost["full@0.5"]["edits"] = 0.01  # each's edit γ does move its protection: no such sentence
    assert "moves neither side" not in seq_streams.gradient_share_part([(Path(tmp_path / "a.json"), run)])
    # another stream of edits: its own table, its rounds apart from the first stream's
    later = {**run, "edits": {"file": "zsre_dev.json", "offset": 0, "n": 300}}
    later["gradient_share"] = {k: {"qa": share} for k in ("2", "3")}
    later["exposure"] = {k: cost for k in ("2", "3")}
    text = seq_streams.gradient_share_part([(Path(tmp_path / "a.json"), run), (Path(tmp_path / "b.json"), later)])
    assert "zsre_dev.json 200–399 in rounds of 100:" in text and "zsre_dev.json 0–299 in rounds of 100:" in text
    assert "| 3 | [full@0.5, apart, 2 sweeps](seq_room/b.json) | 0.451 | 0.0109 | 0.0071 |" in text
    assert "| 2 | [full@0.5, apart, 2 sweeps](seq_room/a.json) | 0.451 |" in text
    assert text.count("Over rounds 2–3: ") == 1  # the one stream measured over more than one round
    assert "`full@0.8, mix 0.5` keeps 0.36 and spends 0.0021; `full@0.5, mix 0.5` keeps 0.36 and spends 0.0100;" in text
    assert "earlier edits' answers" not in text
    cost["full@0.8:apart2"]["edit targets"] = 0.0011  # a run with target rows: the answers' column
    text = seq_streams.gradient_share_part([(Path(tmp_path / "a.json"), run)])
    assert "| 2 | [full@0.8, apart, 2 sweeps](seq_room/a.json) | 0.326 | 0.0074 | 0.0024 | 0.0011 |" in text
    assert "| 2 | [full@0.8, mix 0.5](seq_room/a.json) | 0.360 | 0.0095 | 0.0021 | – |" in text
    assert "At about the same room" not in text  # no target rows
    share["target@0.8:apart2"] = 0.446  # a target row beside a full row of about the same room, answers measured
    cost["target@0.8:apart2"] = {"capability": 0.0108, "edits": 0.0109, "edit targets": 0.0073}
    cost["full@0.5:apart2"]["edit targets"] = 0.0241
    text = seq_streams.gradient_share_part([(Path(tmp_path / "a.json"), run)])
    assert (
        "At about the same room, apart with the edit factors at the target positions (edit γ 0.8) keeps 0.45 and a "
        "step spends 0.0073 of the earlier edits' answers' curvature; with them over every position (edit γ 0.5), "
        "0.45 and 0.0241:" in text
    )
    del run["exposure"]
    assert "What a step inside each constraint costs" not in seq_streams.gradient_share_part([(tmp_path, run)])
