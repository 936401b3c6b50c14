"""``crispedit demo``: the embedded default job (registered through ``crispedit.cli._COMMAND_MODULES``)."""

from __future__ import annotations

__all__ = ["add_cli", "cmd_demo"]


def cmd_demo(args) -> int:
    """``crispedit demo``: the embedded default job (:func:`crispedit.demo.run_demo`)."""
    from ..demo import run_demo

    return run_demo(
        n_edits=args.n_edits,
        epochs=args.epochs,
        gamma=args.gamma,
        n_cap=args.n_cap,
        model_spec=args.model,
        show=args.show,
        precision=args.precision,
        kl_texts=args.kl_texts,
    )


def add_cli(sub) -> None:
    """Register ``crispedit demo`` on ``subparsers``."""
    from ..editing.config import PRECISIONS  # torch-free

    d = sub.add_parser("demo", help="edit bundled ZsRE facts into SmolLM2 with crispedit and ft; show before/after")
    d.add_argument("--model", default="smollm2", help="the model to edit (default smollm2, the embedded one)")
    d.add_argument("--n-edits", type=int, default=6, help="bundled ZsRE facts to edit in (default 6)")
    d.add_argument("--epochs", type=int, default=100, help="cap on training epochs of each method (default 100)")
    d.add_argument(
        "--gamma",
        type=float,
        default=0.8,
        help="crispedit's energy threshold in (0, 1) (default 0.8)",
    )
    d.add_argument("--n-cap", type=int, default=16, help="capability texts for the curvature")
    d.add_argument("--show", type=int, default=6, help="rows in the before/after table")
    d.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="auto",
        help="the training forward's precision (as crispedit edit --precision; default auto: bf16 where "
        "the hardware computes it natively, else fp32)",
    )
    d.add_argument("--kl-texts", type=int, default=16, help="held-out paragraphs the KL drift is measured on")
    d.set_defaults(func=cmd_demo)
