"""Evaluation: WILD generation + judges, teacher-forced edit metrics, capability drift (KL / perplexity),
lm-eval capability tasks (``run_capabilities``; lm-eval is imported only when a task runs) and run
reports (``write_report``). See docs/evaluation.md."""

from .capabilities import TASKS, capability_drift, ensure_punkt_offline, parse_tasks, run_capabilities
from .drift import kl_drift, perplexity, swapped_weights
from .edit_eval import evaluate_edit
from .generation import generate_answers
from .judges import OpenAIJudge, RuleJudge, make_judge
from .report import markdown_table, write_report
from .teacher_forced import edit_scores, score_pairs, summarize_edit_scores
from .wild import CONTEXTS, WildConfig, render_prompt, run_wild

__all__ = ["evaluate_edit", "kl_drift", "perplexity", "swapped_weights", "edit_scores", "score_pairs", "summarize_edit_scores",
           "generate_answers", "RuleJudge", "OpenAIJudge", "make_judge", "run_wild", "render_prompt", "WildConfig",
           "CONTEXTS", "TASKS", "run_capabilities", "capability_drift", "parse_tasks", "ensure_punkt_offline",
           "markdown_table", "write_report"]
