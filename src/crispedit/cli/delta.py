"""``crispedit delta info|apply|revert|export-lora``: edits as reversible delta files (:mod:`crispedit.delta`).

Torch-free at import: the delta file's header is read and checked without torch
(:func:`crispedit.delta_format.read_delta_header`; ``delta info`` never imports it); ``apply``, ``revert``
and ``export-lora`` check their arguments and output directory, then import the heavy modules to load the
model.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..checks import check_positive_int
from ..delta_format import check_lora_rank, read_delta_header
from ..paths import check_output_dir
from ..versions import read_record, stamped

__all__ = ["add_cli"]


def cmd_info(args) -> int:
    """``crispedit delta info DELTA``: what the delta holds (``--json``: all of its metadata). Torch-free."""
    meta = read_delta_header(args.delta)
    if args.json:
        print(json.dumps(meta, indent=2))
        return 0
    size = Path(args.delta).stat().st_size
    params = meta["parameters"]
    numel = sum(_prod(p["shape"]) for p in params.values())
    patches = sum(p["apply_patch"] + p["revert_patch"] for p in params.values())

    def f(v):
        """``v`` to six decimals, ``-`` for None."""
        return "-" if v is None else f"{v:.6f}"

    print(
        f"delta {args.delta}: {meta.get('method', '?')} edit of {meta.get('model_type')} ({meta['dtype']}), "
        f"{len(meta.get('requests') or [])} edit requests, {size / 2**20:.2f} MiB"
    )
    print(f"  base fingerprint   {meta['base_fingerprint']}")
    print(f"  edited fingerprint {meta['edited_fingerprint']}")
    print(f"  kl_predicted {f(meta.get('kl_predicted'))}  kl_drift (measured) {f(meta.get('kl_drift'))}  nats/token")
    print(f"  {len(params)} changed tensors, {numel} values, {patches} exactness patch entries")
    for name, p in params.items():
        print(
            f"    {name}  {'x'.join(map(str, p['shape']))} {p['dtype']}  patches apply {p['apply_patch']} "
            f"revert {p['revert_patch']}"
        )
    return 0


def _num(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _load(args, meta: dict):
    from ..models import load_model

    return load_model(
        args.model,
        dtype=meta["dtype"],
        device=None,
        trust_remote_code=args.trust_remote_code,
        progress=False if args.quiet else None,
    )


def _apply_or_revert(args, revert: bool) -> int:
    meta = read_delta_header(args.delta)
    check_output_dir(args.out, overwrite=False)
    model, tok = _load(args, meta)
    from ..atomic import atomic_directory, atomic_write_json
    from ..delta import apply_delta, revert_delta
    from ..model_card import write_card
    from ..models import save_model_dir

    (revert_delta if revert else apply_delta)(model, args.delta)
    verb = "reverted" if revert else "applied"
    with atomic_directory(args.out) as tmp:
        save_model_dir(model, tok, tmp, progress=False if args.quiet else None, what=f"the {verb} delta")
        write_card(tmp, _card(args, meta, revert))
        atomic_write_json(
            tmp / "crispedit_delta.json",
            stamped(
                {
                    "delta": str(args.delta),
                    "operation": "revert" if revert else "apply",
                    "model": str(args.model),
                    "method": meta.get("method"),
                    "result_fingerprint": meta["base_fingerprint" if revert else "edited_fingerprint"],
                }
            ),
        )
    print(f"delta {verb}: {'base' if revert else 'edited'} model written to {args.out}")
    return 0


def _edit_report_of(delta: str, meta: dict) -> dict:
    """The ``edit_report.json`` next to ``delta`` when it was written with this very delta (same edited
    fingerprint): its measurements describe the model ``delta apply`` writes, bit for bit. ``{}`` otherwise; one
    line for a report another crispedit version wrote (:func:`~crispedit.versions.read_record`)."""
    report = read_record(Path(delta).parent / "edit_report.json", "rerun the edit")
    ok = (
        isinstance(report.get("delta"), dict)
        and report["delta"].get("edited_fingerprint") == meta["edited_fingerprint"]
    )
    return report if ok else {}


def _card(args, meta: dict, revert: bool) -> str:
    """The model card of the folder ``delta apply`` / ``revert`` writes (:mod:`crispedit.model_card`)."""
    from ..model_card import build_card, hub_base_model, restored_card, revert_lines

    # The delta's fingerprint check makes the model here the delta's base (apply) or its edited model (revert),
    # so the base the delta recorded (e.g. `smollm2`) names it when --model is a bare local path.
    recorded = meta.get("model") if isinstance(meta.get("model"), str) else None
    delta = str(Path(args.delta).resolve())
    if revert:
        return restored_card(
            recorded or hub_base_model(args.model),
            method=meta.get("method") or "unknown",
            delta=delta,
            edited=str(args.model),
        )
    unresolved = hub_base_model(args.model) == str(args.model)
    base_spec = recorded if recorded and unresolved and hub_base_model(recorded) != recorded else args.model
    summary = {"kl_drift": meta.get("kl_drift"), "kl_predicted": meta.get("kl_predicted")}
    report = {
        "method": meta.get("method"),
        "config": meta.get("config"),
        "model": base_spec,
        "n_edits": len(meta.get("requests") or []),
        "requests": meta.get("requests") or [],
        "summary": summary,
        "layers": meta.get("layers"),
    }
    earlier = _edit_report_of(args.delta, meta)
    note = None
    if earlier:
        report.update(summary=earlier.get("summary") or summary, wild=earlier.get("wild"))
        note = (
            f"The figures are those of the edit report written with this delta "
            f"(`{Path(args.delta).parent.resolve() / 'edit_report.json'}`): the model here is bit-identical "
            "to the one measured there."
        )
    else:
        note = (
            "Only the drift figures travel in the delta file; the others were not measured on this model "
            "(`crispedit eval` measures them)."
        )
    return build_card(
        report,
        made_by=f"`crispedit delta apply` of `{delta}` to `{args.model}`",
        revert=revert_lines(delta, where="MODEL_DIR is this folder"),
        note=note,
    )


def cmd_apply(args) -> int:
    """``crispedit delta apply DELTA --model BASE --out DIR``: the edited model, bit for bit."""
    return _apply_or_revert(args, revert=False)


def cmd_revert(args) -> int:
    """``crispedit delta revert DELTA --model EDITED --out DIR``: the base model back, bit for bit."""
    return _apply_or_revert(args, revert=True)


def cmd_export_lora(args) -> int:
    """``crispedit delta export-lora DELTA --model BASE --rank R --out DIR``: a peft LoRA adapter (truncated
    SVD of every ΔW), printing the relative Frobenius error per layer."""
    rank = check_positive_int("--rank", args.rank)  # before the delta is read
    meta = read_delta_header(args.delta)
    check_lora_rank("--rank", rank, meta, args.delta)
    check_output_dir(args.out, overwrite=False)
    model, tok = _load(args, meta)
    from ..delta import export_lora

    report = export_lora(
        model, args.delta, rank, args.out, base_name=str(args.model), tokenizer=tok, evaluate=args.evaluate
    )
    scores = report.pop("scores", None)
    for name, r in report.items():
        print(f"  {name}: rank {r['rank']} of {r['rank_full']}, relative Frobenius error {r['rel_error']:.4f}")
    if scores:
        for what, sc in scores.items():
            print(
                f"  {what:7s}: rel={_num(sc.get('rel'))} gen={_num(sc.get('gen'))} (teacher-forced, the delta's "
                f"{len(meta.get('requests') or [])} edits)"
            )
    print(f"LoRA adapter (rank {rank}) written to {args.out}")
    return 0


def add_cli(sub) -> None:
    """Register ``crispedit delta info|apply|revert|export-lora`` on ``subparsers``."""
    p = sub.add_parser("delta", help="edits as reversible delta files: info, apply, revert, export as LoRA")
    ds = p.add_subparsers(dest="delta_command", required=True)

    i = ds.add_parser("info", help="what a delta file holds")
    i.add_argument("delta", help="a delta file (delta.safetensors)")
    i.add_argument("--json", action="store_true", help="print all of its metadata as JSON")
    i.set_defaults(func=cmd_info)

    for name, func, what, helptext in (
        ("apply", cmd_apply, "BASE", "write the base model with the edit applied (bit-exact)"),
        ("revert", cmd_revert, "EDITED", "write the edited model with the edit taken out (bit-exact)"),
    ):
        a = ds.add_parser(name, help=helptext)
        a.add_argument("delta", help="a delta file (delta.safetensors)")
        a.add_argument(
            "--model",
            required=True,
            metavar=what,
            help=f"the {'base' if name == 'apply' else 'edited'} model (checked by fingerprint)",
        )
        a.add_argument("--out", required=True, help="output model directory; must be new or empty")
        a.add_argument(
            "--trust-remote-code", action="store_true", help="allow model code from the hub (off by default)"
        )
        a.add_argument("--quiet", action="store_true", help="no progress bars")
        a.set_defaults(func=func)

    e = ds.add_parser("export-lora", help="write the delta as a peft LoRA adapter (truncated SVD of each ΔW)")
    e.add_argument("delta", help="a delta file (delta.safetensors)")
    e.add_argument("--model", required=True, metavar="BASE", help="the base model (checked by fingerprint)")
    e.add_argument(
        "--rank",
        type=int,
        required=True,
        help="adapter rank R: at most min(d_out, d_in) of the delta's largest changed matrix",
    )
    e.add_argument("--out", required=True, help="adapter directory; must be new or empty")
    e.add_argument(
        "--evaluate",
        action="store_true",
        help="also score the delta's own edit requests (teacher-forced rel/gen) with the full delta and "
        "with the adapter",
    )
    e.add_argument("--trust-remote-code", action="store_true", help="allow model code from the hub (off by default)")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    e.set_defaults(func=cmd_export_lora)
