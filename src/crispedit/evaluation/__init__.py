"""Evaluation: WILD generation + judges, teacher-forced edit metrics, capability drift (KL / perplexity),
lm-eval capability tasks (``run_capabilities``; lm-eval is imported only when a task runs) and run
reports (``write_report``). See docs/evaluation.md.

Each name below is imported from its module on first use, so the command line can check its arguments
(task names, judge, WILD settings) without importing torch."""

from .._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(
        ["TASKS", "capability_drift", "ensure_punkt_offline", "parse_tasks", "run_capabilities"], ".capabilities"
    ),
    **dict.fromkeys(["kl_drift", "perplexity", "swapped_weights"], ".drift"),
    "evaluate_edit": ".edit_eval",
    "generate_answers": ".generation",
    **dict.fromkeys(["OpenAIJudge", "RuleJudge", "make_judge"], ".judges"),
    **dict.fromkeys(["markdown_table", "write_report"], ".report"),
    **dict.fromkeys(["edit_scores", "score_pairs", "summarize_edit_scores"], ".teacher_forced"),
    **dict.fromkeys(
        ["EVAL_WRAPPERS", "HELD_OUT_WRAPPER", "WildConfig", "crosstalk", "render_prompt", "run_wild"], ".wild"
    ),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "evaluate_edit",
    "kl_drift",
    "perplexity",
    "swapped_weights",
    "edit_scores",
    "score_pairs",
    "summarize_edit_scores",
    "generate_answers",
    "RuleJudge",
    "OpenAIJudge",
    "make_judge",
    "run_wild",
    "crosstalk",
    "render_prompt",
    "WildConfig",
    "EVAL_WRAPPERS",
    "HELD_OUT_WRAPPER",
    "TASKS",
    "run_capabilities",
    "capability_drift",
    "parse_tasks",
    "ensure_punkt_offline",
    "markdown_table",
    "write_report",
]
