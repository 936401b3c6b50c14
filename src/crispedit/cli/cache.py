"""``crispedit cache build|info|list``: the capability curvature caches (registered through
``crispedit.cli._COMMAND_MODULES``). Torch-free at import; ``build`` may run under ``torchrun`` (the corpus
sharded across processes, rank 0 writes; with ``--shard`` the model's decoder blocks split across them too)."""

from __future__ import annotations

import json
from pathlib import Path

from ..curvature.modes import CACHE_KINDS  # torch-free
from ..errors import CrispEditError
from ..paths import check_input_dir, check_input_file, check_output_dir, check_output_file
from .flags import add_curvature_args, add_model_args, add_shard_arg, check_shard_launch, settings_from_args

__all__ = ["add_cli", "cmd_cache_build", "cmd_cache_info", "cmd_cache_list"]


def cmd_cache_build(args) -> int:
    """``crispedit cache build``: collect (or reuse) the capability K-FAC factors and optionally export them to
    ``--out``."""
    from ..data import capability_corpus
    from ..editing import EditConfig

    config = EditConfig(**settings_from_args(args, EditConfig))  # the layers and curvature flags, the rest default
    if args.out:
        check_output_file(args.out)
    if args.cache_dir:
        check_output_dir(args.cache_dir, "--cache-dir")  # a file there, or a root that takes no entries: now
    check_shard_launch(args)
    if args.shard and args.kind != "kfac":
        raise CrispEditError("--shard collects K-FAC factors (--kind kfac); build the input covariances in one process")
    capability_corpus(config.cap_corpus, config.n_cap)  # a bad corpus fails before the model loads
    from ..curvature.cache import save_factors
    from ..distributed import is_main, process_group_from_env, shard_model, world_size
    from ..editing import capability_factors, curvature_spec
    from ..layers import resolve_layers
    from ..models import cache_dir, load_model
    from ..weights import weight_fingerprint

    with process_group_from_env(args.device) as device:  # under torchrun: shard the corpus, rank 0 writes
        progress = False if args.quiet or not is_main() else None
        model, tok = load_model(
            args.model,
            dtype=args.dtype,
            device=None if args.shard else device,
            trust_remote_code=args.trust_remote_code,
            progress=progress,
        )
        layers = resolve_layers(model, config.layers)
        fp = weight_fingerprint(model)  # of the whole model, before any split: the key a one-process run uses
        if args.shard:  # the decoder blocks split across the processes (nothing trains: nothing kept whole)
            shard_model(model, keep=(), device=device)
        factors, info = capability_factors(
            model,
            tok,
            layers,
            config,
            cache_root=args.cache_dir or cache_dir(),
            fingerprint=fp,
            force=args.force,
            progress=progress,
            kind=args.kind,
        )
        path = info["path"]
        if args.out:
            if is_main():
                save_factors(
                    args.out,
                    factors,
                    curvature_spec(model, list(layers), config, fp, args.kind),
                    extra={"collect_seconds": info["seconds"], "processes": world_size()},
                )
            path = args.out
        procs = f" on {world_size()} processes" if world_size() > 1 else ""
        state = "reused" if info["hit"] else f"built in {info['seconds']:.1f}s{procs}"
        if is_main():
            what = "K-FAC factors" if args.kind == "kfac" else "input covariances"
            print(f"{what} for {len(layers)} layers ({factors.n_tokens} tokens) {state}: {path}")
    return 0


def cmd_cache_info(args) -> int:
    """``crispedit cache info FILE``: print a factor file's metadata and factor shapes as JSON."""
    check_input_file(args.file, "curvature cache file")
    from ..curvature.cache import load_factors

    factors = load_factors(args.file)
    meta = dict(factors.meta)
    meta["shapes"] = {
        k: [list(factors.A[k].shape)] + ([list(factors.S[k].shape)] if k in factors.S else []) for k in factors.A
    }
    print(json.dumps(meta, indent=2))
    return 0


def cmd_cache_list(args) -> int:
    """``crispedit cache list``: one line per cached factor file (layers, texts, length, labels, model)."""
    if args.cache_dir:
        check_input_dir(args.cache_dir, "--cache-dir", missing_ok=True)  # absent: nothing cached yet
    from ..curvature.cache import load_factors
    from ..models import cache_dir

    root = Path(args.cache_dir or cache_dir()) / "kfac"
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        print(f"no cached factors under {root}")
    for f in files:
        try:
            spec = load_factors(f).meta.get("spec", {})
            print(
                f"{f}  kind={spec.get('kind')} layers={len(spec.get('layers', []))} n={spec.get('n_texts')} "
                f"len={spec.get('max_len')} "
                f"labels={spec.get('label_mode')} model={str(spec.get('model_fingerprint'))[:12]}"
            )
        except CrispEditError as exc:
            print(f"{f}  (unreadable: {exc})")
    return 0


def add_cli(sub) -> None:
    """Register ``crispedit cache build|info|list`` on ``subparsers``."""
    pc = sub.add_parser("cache", help="build or inspect K-FAC curvature caches")
    csub = pc.add_subparsers(dest="cache_command", required=True)
    b = csub.add_parser("build", help="collect capability K-FAC factors or input covariances (reused by `edit`)")
    add_model_args(b)
    add_curvature_args(b)
    b.add_argument(
        "--kind",
        choices=list(CACHE_KINDS),
        default="kfac",
        help="kfac: K-FAC factors A and S (crispedit, adam-nscl; default); input: the input covariance "
        "E[k k^T] alone, forward only (memit, alphaedit)",
    )
    b.add_argument("--cache-dir", default=None, help="cache root (default $CRISPEDIT_CACHE or ~/.cache/crispedit)")
    b.add_argument("--out", default=None, help="also write the factors to this file (for `edit --cache`)")
    b.add_argument("--force", action="store_true", help="recollect even if cached")
    add_shard_arg(b)
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.set_defaults(func=cmd_cache_build, torchrun=True)  # may run under torchrun
    i = csub.add_parser("info", help="print a cache file's metadata")
    i.add_argument("file", help="a cached factors file (.safetensors)")
    i.set_defaults(func=cmd_cache_info)
    ls = csub.add_parser("list", help="list cached factor files")
    ls.add_argument("--cache-dir", default=None, help="cache root (default $CRISPEDIT_CACHE or ~/.cache/crispedit)")
    ls.set_defaults(func=cmd_cache_list)
