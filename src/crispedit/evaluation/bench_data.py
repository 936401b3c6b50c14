"""Local benchmark files -> the document schema of lm-evaluation-harness's stock tasks.

The YAML configs in ``evaluation/tasks`` call these loaders through ``custom_dataset`` with the
benchmark directory (``bench_dir``, from ``--bench-dir`` / ``CRISPEDIT_BENCH_DIR``) in the task
metadata. Expected layout (the public releases, unmodified)::

    arc_challenge/ARC-Challenge-Test.jsonl   (+ optional ARC-Challenge-Train.jsonl for few-shot)
    mmlu/dev/{subject}_dev.csv  mmlu/test/{subject}_test.csv   (hendrycks/test CSVs, no header)
    gsm8k/test.jsonl
    truthfulqa/mc_task.json                  (sylinrl/TruthfulQA mc1/mc2 targets)
    ifeval/input_data.jsonl                  (google-research instruction_following_eval)

Without an ARC train file, ARC few-shot examples are drawn from the other test items (lm-eval drops
the evaluated item from its own context when the few-shot and test splits coincide).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from ..errors import CrispEditError
from ..paths import check_input_dir

__all__ = [
    "TASK_FILES",
    "MMLU_SUBJECTS",
    "bench_path",
    "required_files",
    "load_arc",
    "load_mmlu",
    "load_gsm8k",
    "load_truthfulqa_mc",
    "load_ifeval",
]

MMLU_SUBJECTS = (
    "abstract_algebra",
    "anatomy",
    "astronomy",
    "business_ethics",
    "clinical_knowledge",
    "college_biology",
    "college_chemistry",
    "college_computer_science",
    "college_mathematics",
    "college_medicine",
    "college_physics",
    "computer_security",
    "conceptual_physics",
    "econometrics",
    "electrical_engineering",
    "elementary_mathematics",
    "formal_logic",
    "global_facts",
    "high_school_biology",
    "high_school_chemistry",
    "high_school_computer_science",
    "high_school_european_history",
    "high_school_geography",
    "high_school_government_and_politics",
    "high_school_macroeconomics",
    "high_school_mathematics",
    "high_school_microeconomics",
    "high_school_physics",
    "high_school_psychology",
    "high_school_statistics",
    "high_school_us_history",
    "high_school_world_history",
    "human_aging",
    "human_sexuality",
    "international_law",
    "jurisprudence",
    "logical_fallacies",
    "machine_learning",
    "management",
    "marketing",
    "medical_genetics",
    "miscellaneous",
    "moral_disputes",
    "moral_scenarios",
    "nutrition",
    "philosophy",
    "prehistory",
    "professional_accounting",
    "professional_law",
    "professional_medicine",
    "professional_psychology",
    "public_relations",
    "security_studies",
    "sociology",
    "us_foreign_policy",
    "virology",
    "world_religions",
)

TASK_FILES = {
    "arc_challenge": ["arc_challenge/ARC-Challenge-Test.jsonl"],
    "mmlu": [f"mmlu/{split}/{s}_{split}.csv" for s in MMLU_SUBJECTS for split in ("dev", "test")],
    "gsm8k_cot": ["gsm8k/test.jsonl"],
    "truthfulqa_mc2": ["truthfulqa/mc_task.json"],
    "ifeval": ["ifeval/input_data.jsonl"],
}


def bench_path(bench_dir: str | os.PathLike | None, rel: str) -> Path:
    """``bench_dir / rel``; one-line error when no benchmark directory is given."""
    if not bench_dir:
        raise CrispEditError("no benchmark directory: pass --bench-dir DIR or set CRISPEDIT_BENCH_DIR")
    return Path(bench_dir).expanduser() / rel


def required_files(task: str, bench_dir: str | os.PathLike) -> list[Path]:
    """The files ``task`` reads; raises a one-line error naming the first that is missing."""
    root = check_input_dir(Path(bench_dir).expanduser(), "benchmark directory")
    paths = [root / rel for rel in TASK_FILES[task]]
    for p in paths:
        if not p.is_file():
            raise CrispEditError(f"benchmark file for {task} not found: {p}")
    return paths


def _jsonl(path: Path) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except FileNotFoundError:
        raise CrispEditError(f"benchmark file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise CrispEditError(f"{path}: malformed JSON line: {exc.msg}") from None


def _dataset_dict(splits: dict[str, list[dict]]):
    import datasets

    return datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()})


def _arc_doc(rec: dict) -> dict:
    q = rec["question"]
    return {
        "id": rec["id"],
        "question": q["stem"],
        "choices": {"text": [c["text"] for c in q["choices"]], "label": [c["label"] for c in q["choices"]]},
        "answerKey": rec["answerKey"],
    }


def load_arc(bench_dir=None, **_):
    """ARC-Challenge from local JSONL as a ``datasets.DatasetDict`` (test; train = the train file, else test)."""
    test = [_arc_doc(r) for r in _jsonl(bench_path(bench_dir, "arc_challenge/ARC-Challenge-Test.jsonl"))]
    train_p = bench_path(bench_dir, "arc_challenge/ARC-Challenge-Train.jsonl")
    train = [_arc_doc(r) for r in _jsonl(train_p)] if train_p.is_file() else test
    return _dataset_dict({"test": test, "train": train})


def _mmlu_rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise CrispEditError(f"benchmark file not found: {path}")
    out = []
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.reader(fh):
            if len(row) != 6:
                raise CrispEditError(f"{path}: expected 6 columns (question, A, B, C, D, answer), got {len(row)}")
            out.append({"question": row[0], "choices": row[1:5], "answer": "ABCD".index(row[5].strip())})
    return out


def load_mmlu(bench_dir=None, subject: str = "", **_):
    """One MMLU subject from local CSVs as a ``DatasetDict`` (test, dev; answer as index 0-3)."""
    return _dataset_dict(
        {
            "test": _mmlu_rows(bench_path(bench_dir, f"mmlu/test/{subject}_test.csv")),
            "dev": _mmlu_rows(bench_path(bench_dir, f"mmlu/dev/{subject}_dev.csv")),
        }
    )


def load_gsm8k(bench_dir=None, **_):
    """GSM8K test from local JSONL as a ``DatasetDict`` (question, answer)."""
    rows = [
        {"question": r["question"], "answer": r["answer"]} for r in _jsonl(bench_path(bench_dir, "gsm8k/test.jsonl"))
    ]
    return _dataset_dict({"test": rows})


def _targets(d: dict) -> dict:
    items = sorted(d.items(), key=lambda kv: -int(kv[1]))  # true answers first (lm-eval's mc2 expects it)
    return {"choices": [k for k, _ in items], "labels": [int(v) for _, v in items]}


def load_truthfulqa_mc(bench_dir=None, **_):
    """TruthfulQA multiple choice (mc1/mc2 targets) from the local ``mc_task.json`` as a ``DatasetDict``."""
    path = bench_path(bench_dir, "truthfulqa/mc_task.json")
    try:
        recs = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CrispEditError(f"benchmark file not found: {path}") from None
    rows = []
    for r in recs:
        mc1 = r["mc1_targets"]
        # mc1 keeps the file's order: the single correct answer first, as in the hub's copy
        rows.append(
            {
                "question": r["question"],
                "mc1_targets": {"choices": list(mc1), "labels": [int(v) for v in mc1.values()]},
                "mc2_targets": _targets(r["mc2_targets"]),
            }
        )
    return _dataset_dict({"validation": rows})


def load_ifeval(bench_dir=None, **_):
    """IFEval prompts from local JSONL as a ``DatasetDict`` (kwargs JSON-encoded per row)."""
    rows = []
    for r in _jsonl(bench_path(bench_dir, "ifeval/input_data.jsonl")):
        # JSON-encode kwargs: their keys differ per instruction; the task's process_results decodes them
        rows.append(
            {
                "key": r["key"],
                "prompt": r["prompt"],
                "instruction_id_list": r["instruction_id_list"],
                "kwargs_json": json.dumps(r["kwargs"]),
            }
        )
    return _dataset_dict({"train": rows})
