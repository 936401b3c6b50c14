"""Round-1 retention of sequential compare rows: the series, the summary, the markdown table and the picture."""

from crispedit.experiments.retention import (
    final_by_round,
    landed_by_round,
    plot_retention,
    retention_rows,
    retention_series,
    retention_summary,
    retention_table,
)


def _rec(tf, qa, chat):
    return {"n": 4, "tf_rel": tf, "wild": {"qa": qa, "chat": chat}}


PAYLOAD = {
    "methods": ["crispedit", "crispedit-seq", "ft-seq"],
    "results": {
        "base": {},
        "crispedit": {"summary": {}},
        "crispedit-seq": {"retention": [_rec(1.0, 0.75, 1.0), _rec(1.0, 0.5, 0.75), _rec(0.75, 0.5, 0.5)]},
        "ft-seq": {"retention": [_rec(1.0, 0.5, None), None, _rec(0.25, 0.0, None)]},
    },
}


def test_series_and_summary_read_each_rounds_record():
    assert retention_rows(PAYLOAD) == ["crispedit-seq", "ft-seq"]  # batch rows have no rounds
    s = retention_series(PAYLOAD["results"]["ft-seq"])
    assert s == {"tf_rel": [1.0, None, 0.25], "qa": [0.5, None, 0.0], "chat": [None, None, None]}
    summ = retention_summary(PAYLOAD["results"]["crispedit-seq"])
    assert summ["qa"] == {"first": 0.75, "last": 0.5, "kept": 0.5 / 0.75}
    assert summ["tf_rel"]["kept"] == 0.75 and summ["chat"]["kept"] == 0.5
    ft = retention_summary(PAYLOAD["results"]["ft-seq"])
    assert ft["qa"]["kept"] == 0.0 and ft["chat"]["kept"] is None  # never measured: no ratio


def test_table_lists_every_round_and_the_kept_share():
    md = retention_table(PAYLOAD)
    assert "the first round's 4 edits" in md
    assert "| row | measure | r1 | r2 | r3 | kept (last / r1) |" in md
    assert "| crispedit-seq | WILD qa rel | 0.75 | 0.50 | 0.50 | 0.67 |" in md
    assert "| ft-seq | teacher-forced rel | 1.00 | – | 0.25 | 0.25 |" in md
    assert "| ft-seq | WILD chat rel |" not in md  # a measure never taken is left out
    assert retention_table({"methods": ["ft"], "results": {"ft": {}}}) == ""


def test_picture_is_written_only_with_retention(tmp_path):
    assert plot_retention(PAYLOAD, tmp_path / "r.png") is True
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    assert plot_retention({"methods": [], "results": {}}, tmp_path / "none.png") is False
    assert not (tmp_path / "none.png").exists()


def test_a_batched_closed_form_row_reads_as_its_first_batch_after_every_batch(tmp_path):
    """A batched AlphaEdit row (AlphaEdit-Seq in rounds of its batch size) joins the table with its first batch's
    teacher-forced series; a round it did not measure (a resumed older checkpoint) reads as missing."""
    payload = {
        "methods": ["alphaedit", "memit", "ft-seq"],
        "results": {
            "alphaedit": {"training": {"first_batch_tf_rel": [None, 0.5, 0.25]}},
            "memit": {"training": {"first_batch_tf_rel": None}},  # one batch: no series
            "ft-seq": PAYLOAD["results"]["ft-seq"],
        },
    }
    assert retention_rows(payload) == ["alphaedit", "ft-seq"]
    s = retention_series(payload["results"]["alphaedit"])
    assert s == {"tf_rel": [None, 0.5, 0.25], "qa": [None] * 3, "chat": [None] * 3}
    assert retention_summary(payload["results"]["alphaedit"])["tf_rel"]["kept"] is None  # no round 1 to divide by
    md = retention_table(payload)
    assert "| alphaedit (batch 1, after each batch) | teacher-forced rel | – | 0.50 | 0.25 | – |" in md
    assert "alphaedit (batch 1, after each batch) | WILD qa rel" not in md
    only = retention_table({"methods": ["alphaedit"], "results": {"alphaedit": payload["results"]["alphaedit"]}})
    assert "the first round's edits measured" in only
    assert plot_retention(payload, tmp_path / "r.png") is True


def test_every_rounds_edits_on_the_final_model_read_off_the_per_edit_records():
    """Rounds are consecutive slices of the round size (``seq_chunk``; a closed-form row's batch size), the last
    one shorter; each measure is the mean of its per-edit verdicts, and a measure without them is left out."""
    seq = {
        "seq_chunk": 2,
        "retention": [_rec(1.0, 1.0, 1.0)],
        "tf": {"rel": [0, 0, 1, 0, 1]},
        "wild": {
            "qa": {
                "answers": [
                    ["a", True, [], []],
                    ["b", False, [], []],
                    ["c", True, [], []],
                    ["d", True, [], []],
                    ["e", False, [], []],
                ]
            }
        },
    }
    assert final_by_round(seq) == {"tf_rel": [0.0, 0.5, 1.0], "qa": [0.5, 1.0, 0.0]}
    batched = {
        "config": {"options": {"batch_size": 3}},
        "training": {"first_batch_tf_rel": [1.0, 0.5]},
        "tf": {"rel": [1, 0, 0, 1, 1, 1]},
    }
    assert final_by_round(batched) == {"tf_rel": [1 / 3, 1.0]}
    assert final_by_round({"tf": {"rel": [1, 0]}}) == {}  # a batch row: no rounds
    assert final_by_round({"config": {"options": {"batch_size": 3}}, "tf": {"rel": [1, 0]}}) == {}  # one batch
    md = retention_table({"methods": ["ft-seq"], "results": {"ft-seq": seq}})
    assert "Every round's edits on the final model" in md
    assert "| ft-seq | teacher-forced rel | 0.00 | 0.50 | 1.00 |" in md
    assert "| ft-seq | WILD qa rel | 0.50 | 1.00 | 0.00 |" in md
    assert "Every round's edits" not in retention_table(PAYLOAD)  # rows stored without per-edit records


def test_what_each_round_landed_reads_its_own_edits_right_after_it():
    """``newest`` of every round's probe, oldest first; a round without one reads as missing, and a row whose probes
    hold none gives nothing (so its table is left out)."""
    newest = [None, {"n": 2, "tf_rel": 1.0, "wild": {"qa": 0.5, "chat": None}}, {"tf_rel": 0.5, "wild": {"qa": 1.0}}]
    row = {
        "seq_chunk": 2,
        "retention": [dict(_rec(1.0, 1.0, 1.0), newest=n) if n else _rec(1.0, 1.0, 1.0) for n in newest],
        "tf": {"rel": [1, 1, 0, 1, 1, 0]},
    }
    assert landed_by_round(row) == {"tf_rel": [None, 1.0, 0.5], "qa": [None, 0.5, 1.0]}
    assert landed_by_round(PAYLOAD["results"]["crispedit-seq"]) == {}
    md = retention_table({"methods": ["crispedit-seq"], "results": {"crispedit-seq": row}})
    landed, final = md.index("right after their round"), md.index("on the final model")
    assert landed < final
    assert "| crispedit-seq | WILD qa rel | – | 0.50 | 1.00 |" in md[landed:final]
    assert "| crispedit-seq | teacher-forced rel | 1.00 | 0.50 | 0.50 |" in md[final:]
