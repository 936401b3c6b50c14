"""Hooks named by the YAML task configs in this folder (lm-eval loads this file by path).

Datasets come from local files (``crispedit.evaluation.bench_data``); scoring reuses lm-eval's own
functions so the numbers mean what the stock tasks' numbers mean.
"""

import json

from crispedit.evaluation.bench_data import load_arc, load_gsm8k, load_ifeval, load_mmlu, load_truthfulqa_mc  # noqa: F401


def process_results_mc2(doc, results):
    """lm-eval's stock TruthfulQA mc2 scoring."""
    from lm_eval.tasks.truthfulqa.utils import process_results_mc2 as stock

    return stock(doc, results)


def ifeval_process_results(doc, results):
    """lm-eval's stock IFEval scoring, with the kwargs decoded and punkt available offline."""
    from crispedit.evaluation.capabilities import ensure_punkt_offline

    ensure_punkt_offline()
    from lm_eval.tasks.ifeval.utils import process_results

    doc = dict(doc)
    doc["kwargs"] = json.loads(doc.pop("kwargs_json"))
    return process_results(doc, results)


def agg_inst_level_acc(items):
    """Instruction-level accuracy: the mean over every instruction of every prompt."""
    flat = [x for sub in items for x in sub]
    return sum(flat) / len(flat) if flat else 0.0
