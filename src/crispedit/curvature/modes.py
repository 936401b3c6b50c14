"""Option enums of the curvature collectors, torch-free so that configs (e.g. the MNIST study's) can
validate them before torch is imported."""

from __future__ import annotations

from enum import Enum

__all__ = ["OutputGrads", "CACHE_KINDS"]

CACHE_KINDS = ("kfac", "input")  # a curvature cache entry: K-FAC factors A and S, or the input covariance A alone


class OutputGrads(str, Enum):
    """How the classifier K-FAC / EK-FAC collectors (:mod:`.ekfac`) form output gradients: every class
    weighted by its probability (``exact``, the true Fisher), one label sampled from the model
    (``sampled``), or the true label (``empirical``)."""

    EXACT = "exact"
    SAMPLED = "sampled"
    EMPIRICAL = "empirical"
