"""Settings of the MNIST curvature study (:mod:`.mnist_study`), torch-free.

:class:`MnistStudyConfig` checks every setting without torch, so ``crispedit study mnist``
(:mod:`crispedit.cli.mnist`) answers every mistake in its flags before the study is imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from ..checks import SEED_MAX, check_float, check_gamma, check_int
from ..errors import CrispEditError
from ..settings import Settings

__all__ = ["METHODS", "OutputGrads", "MnistStudyConfig", "gamma_of"]


class OutputGrads(str, Enum):
    """How the study's classifier K-FAC / EK-FAC collectors (:mod:`.ekfac`) form output gradients: every class
    weighted by its probability (``exact``, the true Fisher), one label sampled from the model (``sampled``), or
    the true label (``empirical``)."""

    EXACT = "exact"
    SAMPLED = "sampled"
    EMPIRICAL = "empirical"


METHODS = ("none", "activation_cov", "kfac", "ekfac", "ggn", "hessian", "hessian_abs")  # cheap first


@dataclass
class MnistStudyConfig(Settings):
    """Every setting of the study, checked on construction; the defaults are the full (paper-size) run."""

    KIND = "MNIST study config"

    data_dir: str | None = None
    out_dir: str = "crispedit-study-mnist"
    seed: int = 0
    methods: tuple[str, ...] = METHODS
    k_values: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 7.0)
    # network: conv(1->c1, 5x5) - pool - conv(c1->c2, 5x5) - pool - fc(16 c2 -> hidden) - fc(hidden -> 10)
    conv1_channels: int = 4
    conv2_channels: int = 8
    hidden: int = 24
    # pre-training on MNIST (Adam, one-cycle schedule)
    pretrain_samples: int | None = None  # None: all 60k
    pretrain_epochs: int = 6
    pretrain_lr: float = 5e-3
    pretrain_batch: int = 128
    target_accuracy: float = 0.985  # a warning is printed below it
    # curvature: all methods use the same seeded subset of the MNIST training set
    curvature_samples: int = 512
    curvature_batch: int = 128
    kfac_output_grads: str = OutputGrads.EXACT.value
    ekfac_per: str = "example"
    # fine-tuning on Fashion-MNIST: projected SGD with momentum
    finetune_steps: int = 400
    finetune_batch: int = 128
    finetune_lr: float = 0.005
    finetune_momentum: float = 0.9
    recompute_drift: float = 0.25
    # Recomputations per fine-tuning run (the paper recomputes whenever the drift passes ``recompute_drift``).
    # Off by default: an exact Hessian is the study's most expensive step, so even one recomputation per gamma
    # would multiply the Hessian sweep's time (the timings: docs/study.md, "Fine-tuning" and "Cost"); every
    # method here uses the projector at the pre-trained weights. ``--max-recomputes 2`` is the paper's protocol.
    max_recomputes: int = 0
    # evaluation on the test sets (None: all 10k)
    eval_samples: int | None = None
    # CPU threads for torch (None: torch's default). On a busy machine fewer threads can be faster: OpenMP
    # threads that wait for each other at every op collapse under oversubscription (docs/study.md).
    threads: int | None = None

    @classmethod
    def quick(cls, **overrides) -> MnistStudyConfig:
        """A CI-sized run (tiny network, subsets, two gammas): seconds, not minutes."""
        base = dict(
            k_values=(1.0, 3.0),
            conv1_channels=2,
            conv2_channels=4,
            hidden=8,
            pretrain_samples=6000,
            pretrain_epochs=1,
            curvature_samples=32,
            curvature_batch=32,
            finetune_steps=30,
            finetune_lr=0.02,
            max_recomputes=1,
            eval_samples=500,
            target_accuracy=0.0,
        )
        base.update(overrides)
        return cls(**base)

    def validate(self) -> MnistStudyConfig:
        """``self`` if every setting is usable; a one-line :class:`CrispEditError` naming the first bad one."""
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise CrispEditError(f"unknown method(s) {unknown or '(none given)'}; choose from {', '.join(METHODS)}")
        for k in self.k_values:
            if not isinstance(k, (int, float)) or not math.isfinite(k) or k <= 0:
                raise CrispEditError(f"k values must be positive numbers (gamma = 1 - 10^-k), got {k!r}")
            check_gamma(gamma_of(k))
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads <= 0):
            raise CrispEditError(f"threads must be a positive integer, got {self.threads!r}")
        for name in (
            "pretrain_epochs",
            "curvature_samples",
            "curvature_batch",
            "finetune_steps",
            "finetune_batch",
            "pretrain_batch",
            "conv1_channels",
            "conv2_channels",
            "hidden",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise CrispEditError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.max_recomputes, int) or self.max_recomputes < 0:
            raise CrispEditError(f"max_recomputes must be a non-negative integer, got {self.max_recomputes!r}")
        check_float("recompute_drift", self.recompute_drift, 0.0, lo_open=True)
        check_int("seed", self.seed, 0, SEED_MAX)
        for name in ("pretrain_lr", "finetune_lr"):
            check_float(name, getattr(self, name), 0.0, 1e3, lo_open=True)
        check_float("finetune_momentum", self.finetune_momentum, 0.0, 1.0, hi_open=True)
        for name in ("pretrain_samples", "eval_samples"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        if self.kfac_output_grads not in {m.value for m in OutputGrads}:
            raise CrispEditError(
                f"kfac_output_grads must be one of {[m.value for m in OutputGrads]}, got {self.kfac_output_grads!r}"
            )
        if self.ekfac_per not in ("example", "row"):
            raise CrispEditError(f"ekfac_per must be 'example' or 'row', got {self.ekfac_per!r}")
        return self


def gamma_of(k: float) -> float:
    """``gamma = 1 - 10^-k``; raises :class:`CrispEditError` when that is not in (0, 1) in float64."""
    g = 1.0 - 10.0 ** (-float(k))
    if not (0.0 < g < 1.0):
        raise CrispEditError(f"k = {k} gives gamma = {g!r}, which is not strictly between 0 and 1")
    return g
