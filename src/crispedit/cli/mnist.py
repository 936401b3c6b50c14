"""``crispedit study mnist``: the command line of the MNIST curvature study (registered through
``crispedit.cli._COMMAND_MODULES``).

Torch-free at import: ``--help`` and every mistake in the flags are answered from the settings
(:mod:`crispedit.experiments.mnist_config`) without importing torch; the study itself
(:func:`crispedit.experiments.mnist_study.run_mnist_study`)
is imported only when it runs.
"""

from __future__ import annotations

import argparse

from ..errors import CrispEditError
from ..experiments.mnist_config import METHODS, MnistStudyConfig
from ..paths import check_output_dir

__all__ = ["config_from_args", "cmd_study_mnist", "add_cli"]


def _parse_list(text: str, kind: type, flag: str) -> tuple:
    try:
        return tuple(kind(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise CrispEditError(f"{flag}: cannot parse {text!r} as a comma-separated list") from None


def config_from_args(args: argparse.Namespace) -> MnistStudyConfig:
    """The validated :class:`MnistStudyConfig` of the parsed ``study mnist`` flags (``--quick``: the CI-sized
    defaults)."""
    overrides = {"seed": args.seed}
    if args.data is not None:
        overrides["data_dir"] = args.data
    if args.out is not None:
        overrides["out_dir"] = args.out
    if args.methods:
        overrides["methods"] = _parse_list(args.methods, str, "--methods")
    if args.k_values:
        overrides["k_values"] = _parse_list(args.k_values, float, "--k-values")
    for flag in ("curvature_samples", "finetune_steps", "pretrain_epochs", "threads", "max_recomputes"):
        if getattr(args, flag) is not None:
            overrides[flag] = getattr(args, flag)
    cfg = MnistStudyConfig.quick(**overrides) if args.quick else MnistStudyConfig(**overrides)
    return cfg  # checked on construction


def cmd_study_mnist(args: argparse.Namespace) -> int:
    """``crispedit study mnist``: check the flags and ``--out``, then run the study (torch is imported only
    then) and print its table and output files."""
    cfg = config_from_args(args)
    check_output_dir(cfg.out_dir)  # an unwritable --out fails now, before torch is imported
    from ..experiments.mnist_study import format_table, run_mnist_study

    report = run_mnist_study(cfg, progress=False if args.quiet else None)
    print(format_table(report["rows"]))
    print(f"total {report['total_seconds']:.0f}s")
    for kind, path in report["files"].items():
        print(f"{kind}: {path}")
    return 0


def add_cli(subparsers) -> None:
    """Register ``crispedit study mnist``."""
    study = subparsers.add_parser("study", help="small-scale experiments from the paper")
    sub = study.add_subparsers(dest="study_command", metavar="{mnist}")
    sub.required = True
    p = sub.add_parser(
        "mnist",
        help="curvature study: MNIST -> Fashion-MNIST with exact Hessian, GGN, K-FAC, "
        "EK-FAC and activation-covariance projections",
    )
    p.add_argument(
        "--data",
        default=None,
        help="directory with mnist/ and fashion_mnist/ IDX .gz files "
        "(default: user cache, downloading the official files when online)",
    )
    p.add_argument("--out", default=None, help=f"output directory (default {MnistStudyConfig.out_dir})")
    p.add_argument("--quick", action="store_true", help="CI-sized run: tiny network, subsets, two gammas")
    p.add_argument("--seed", type=int, default=0, help="seed of the networks, subsets and batches (default 0)")
    p.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument(
        "--k-values",
        default=None,
        help="comma-separated k for gamma = 1 - 10^-k (default "
        + ",".join(f"{k:g}" for k in MnistStudyConfig.k_values)
        + ")",
    )
    p.add_argument("--curvature-samples", type=int, default=None, help="MNIST training examples for every curvature")
    p.add_argument("--finetune-steps", type=int, default=None, help="projected SGD steps on Fashion-MNIST")
    p.add_argument(
        "--pretrain-epochs",
        type=int,
        default=None,
        help=f"epochs of MNIST pre-training (default {MnistStudyConfig.pretrain_epochs})",
    )
    p.add_argument(
        "--max-recomputes",
        type=int,
        default=None,
        help="curvature recomputations per run when the weights drift > 25%% (full default 0; the paper's "
        "protocol is 2 but one exact Hessian takes minutes)",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice; use 1 on a busy machine)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_study_mnist)
