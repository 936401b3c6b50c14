"""Evaluation: teacher-forced edit metrics, capability drift (KL / perplexity)."""

from .drift import kl_drift, perplexity, swapped_weights
from .teacher_forced import edit_scores, score_pairs, summarize_edit_scores

__all__ = ["kl_drift", "perplexity", "swapped_weights", "edit_scores", "score_pairs", "summarize_edit_scores"]
