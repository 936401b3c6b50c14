"""``crispedit mend train``: meta-train MEND's gradient-transform network (registered through
``crispedit.cli._COMMAND_MODULES``).

Torch-free at import: the flags come from :class:`~crispedit.methods.mend.MENDTrainConfig`, every
argument and input file is checked before the model (and torch) is loaded. The training requests default
to ZsRE dev records 1000–1999 (``--offset 1000 --n-edits 1000``), disjoint from the evaluation slice
(100–199) and the tuning slice (400–431) the docs' tables use.
"""

from __future__ import annotations

from dataclasses import fields

from ..checks import check_float, check_int, check_positive_int
from ..errors import CrispEditError
from ..paths import check_output_dir, check_output_file

__all__ = ["add_cli", "cmd_mend_train", "TRAIN_OFFSET", "TRAIN_N"]

TRAIN_OFFSET, TRAIN_N = 1000, 1000  # default training slice: disjoint from evaluation (100-199) and tuning (400-431)


def _train_config(args):
    """The validated :class:`MENDTrainConfig` of the ``--<setting>`` flags (unset ones keep the defaults)."""
    from ..methods.mend import MENDTrainConfig

    given = {
        f.name: getattr(args, f"mend_{f.name}")
        for f in fields(MENDTrainConfig)
        if getattr(args, f"mend_{f.name}", None) is not None
    }
    return MENDTrainConfig(**given)


def _checked_train_args(args, config) -> dict | None:
    """Check ``mend train``'s numbers, output paths and ``--init`` before any work (one-line errors); return the
    metadata of the network ``--init`` continues (``None`` without it), whose settings a continued run keeps."""
    if args.max_minutes is not None:
        check_float("--max-minutes", args.max_minutes, 0.0, lo_open=True)
    if args.n_edits is not None:
        check_positive_int("--n-edits", args.n_edits)
    check_int("--offset", args.offset, 0)
    check_positive_int("--n-cap", args.n_cap)
    prev = None
    if args.init:
        from ..methods.mend.net import read_network_meta

        fixed = sorted(
            f.name.replace("_", "-")
            for f in fields(config)
            if f.name not in ("steps", "seed") and getattr(args, f"mend_{f.name}", None) is not None
        )
        if fixed:
            raise CrispEditError(
                f"--init continues {args.init} with its own settings; drop --{', --'.join(fixed)} "
                "(only --steps and --seed apply)"
            )
        prev = read_network_meta(args.init)
    if args.out:
        check_output_file(args.out)
    if args.cache_dir:  # where the network goes without --out
        check_output_dir(args.cache_dir, "--cache-dir")
    return prev


def _training_record(args, requests, hist: dict, prev: dict | None) -> dict:
    """The ``training`` section a trained network's file keeps: the edit slice, the model, the history ``hist``,
    the digests of the prompts trained on, and, for a run continuing ``prev`` (``--init``), the steps and prompts
    of the runs before it (so overlap warnings see every slice the network was trained on)."""
    from ..methods.mend.net import prompt_digests

    training = {
        "edits": str(args.edits),
        "offset": args.offset,
        "n_edits": len(requests),
        "model": args.model,
        "history": hist,
        "request_digests": prompt_digests(requests),
    }
    before = prev.get("training", {}) if prev is not None else {}
    training["total_steps"] = hist["steps"] + before.get("total_steps", before.get("history", {}).get("steps", 0))
    if prev is not None:
        training["continued_from"] = {
            "file": str(args.init),
            "training": {k: v for k, v in before.items() if k != "request_digests"},
        }
        training["request_digests"] = list(
            dict.fromkeys(before.get("request_digests", []) + training["request_digests"])
        )
    return training


def cmd_mend_train(args) -> int:
    """``crispedit mend train``: check every input, load the model, train, write the network atomically."""
    config = _train_config(args)  # steps >= 1, batch size >= 1, lr in (0, 1]: the ranges `edit` checks
    prev = _checked_train_args(args, config)
    from ..data import capability_corpus, load_edits

    passages = capability_corpus(args.cap_corpus, args.n_cap) if config.loc_texts else []
    requests = load_edits(args.edits, limit=args.n_edits, offset=args.offset)
    if not requests:
        raise CrispEditError(f"{args.edits} has no edit requests from offset {args.offset}")
    progress = False if args.quiet else None
    from ..layers import resolve_layers
    from ..methods.mend.net import default_layers, default_weights_path, load_network, save_network
    from ..methods.mend.train import train_mend
    from ..models import load_model
    from ..weights import weight_fingerprint

    model, tok = load_model(
        args.model, dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code, progress=progress
    )
    layers = resolve_layers(model, args.layers or ",".join(prev["layers"] if prev else default_layers(model)))
    fp = weight_fingerprint(model)
    path = args.out or default_weights_path(fp, list(layers), args.cache_dir)
    start = load_network(args.init, layers, model_fingerprint=fp) if args.init else None
    net, hist = train_mend(
        model,
        tok,
        requests,
        layers,
        config,
        passages=passages,
        net=start,
        max_seconds=None if args.max_minutes is None else 60.0 * args.max_minutes,
        progress=progress,
    )
    h = hist.to_json()
    training = _training_record(args, requests, h, prev)
    save_network(path, net, model_fingerprint=fp, training=training)
    stop = f" (stopped by --max-minutes {args.max_minutes:g})" if h["stopped_early"] else ""
    cont = f", {training['total_steps']} in all from {args.init}" if args.init else ""
    print(
        f"mend: trained {h['steps']} steps{stop}{cont} on {len(requests)} edits (offset {args.offset}) in "
        f"{h['seconds']:.0f}s; "
        f"meta-loss {h['loss'].get('first10', float('nan')):.4f} -> {h['loss'].get('last10', float('nan')):.4f} "
        f"(edit NLL {h['edit_nll'].get('first10', float('nan')):.3f} -> "
        f"{h['edit_nll'].get('last10', float('nan')):.3f}, "
        f"locality KL {h['loc_kl'].get('first10', float('nan')):.4f} -> "
        f"{h['loc_kl'].get('last10', float('nan')):.4f})"
    )
    use = "" if not args.out else f" --mend-weights {path}"
    print(f"network for {len(layers)} layers written to {path}; edit with `crispedit edit --method mend{use} ...`")
    return 0


def add_cli(sub) -> None:
    """Register ``crispedit mend train`` on ``subparsers``."""
    from ..methods.mend import MENDTrainConfig
    from .flags import add_model_args

    p = sub.add_parser("mend", help="train MEND's gradient-transform network (for --method mend)")
    msub = p.add_subparsers(dest="mend_command", required=True)
    t = msub.add_parser("train", help="meta-train MEND on edit requests disjoint from the evaluated ones")
    add_model_args(t)
    t.add_argument(
        "--edits", required=True, help="training edit file (ZsRE, CounterFact/WikiBigEdit or crispedit JSON)"
    )
    t.add_argument(
        "--offset",
        type=int,
        default=TRAIN_OFFSET,
        help=f"first training record (default {TRAIN_OFFSET}: disjoint from the evaluation slice 100-199 "
        "and the tuning slice 400-431)",
    )
    t.add_argument("--n-edits", type=int, default=TRAIN_N, help=f"training records from --offset (default {TRAIN_N})")
    t.add_argument(
        "--layers",
        default=None,
        help="edit layers (default: the MLP linears of the last 3 decoder blocks, as MEND); the edit must use the same",
    )
    t.add_argument(
        "--cap-corpus", default=None, help="text the locality passages are drawn from (default: bundled WikiText)"
    )
    t.add_argument(
        "--n-cap", type=int, default=256, help="capability texts to draw locality passages from (default 256)"
    )
    help_ = {
        "steps": "Adam steps (default 500)",
        "batch_size": "edit requests per step (default 8)",
        "lr": "Adam lr of the network (default 1e-4; authors 1e-6 over ~100k steps)",
        "lr_lr": "Adam lr of the per-layer steps alpha (default 1e-4, authors')",
        "edit_lr": "initial per-layer step alpha (default 1e-4, authors')",
        "rank": "rank of the residual layers (default 1920, authors'; capped at d_in + d_out)",
        "n_hidden": "hidden residual layers (default 1: two layers, authors')",
        "c_edit": "weight of the edit NLL (default 0.1, authors')",
        "c_loc": "weight of the locality KL (default 1.0, authors')",
        "grad_clip": "gradient-norm clip (default 100, authors')",
        "loc_texts": "capability passages in each step's locality batch (default 2)",
        "loc_len": "tokens per locality passage (default 64)",
        "seed": "seed of the sampling and the init",
    }
    for f in fields(MENDTrainConfig):
        kind = type(f.default)
        t.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f"mend_{f.name}",
            type=kind,
            default=None,
            help=help_.get(f.name, f.name),
        )
    t.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="wall-clock budget: stop before a step that would end past it and save the network trained so "
        "far (the file records the steps done)",
    )
    t.add_argument(
        "--init",
        default=None,
        help="continue training this network file (same model and layers; its "
        "settings are kept, only --steps and --seed apply; Adam restarts)",
    )
    t.add_argument("--out", default=None, help="network file (default: the cache, where `edit --method mend` looks)")
    t.add_argument("--cache-dir", default=None, help="cache root (default $CRISPEDIT_CACHE or ~/.cache/crispedit)")
    t.add_argument("--quiet", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_mend_train)
