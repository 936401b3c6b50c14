"""How much room a sequential stream leaves its later rounds, without training: the share of directions each
round's projector would keep, under several edit-factor settings, from edit factors collected on the base model.

A CrispEdit-Seq round trains inside the directions its constraint leaves free — the capability factors merged
with the accumulated edit factors of every earlier round (``--weighting each``: γ of the capability energy and
``edit_gamma`` of the edit energy masked). As the stream grows the edit factors span more directions and later
rounds train in a narrower subspace. This script collects each round's edit factors on the *unedited* model
(where a real stream collects them on the model as its round left it, confident on the new targets: a proxy that
needs no training, closest for ``full``, whose positions are mostly the prompts'), accumulates
them as a session does, and prints the kept fraction of directions per round for every setting: the positions
the factors are collected at (``full`` / ``target``) crossed with the edit γs asked for. Minutes per setting where
a real stream takes hours, so settings can be ranked by the room they leave before one is run.

    python benchmarks/seq_room.py --edits ../shared/data/edits/zsre_dev.json:0:1000 --chunk 100 \\
        --rows full,target --edit-gammas 0.95,0.9,0.8 --json runs/room.json

Run alone: one model job at a time.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from edit_tokens import slice_arg  # noqa: E402  (same folder)
from seq_retention import stream_parser, stream_record  # noqa: E402


def kept(constraint, layers, gamma: float) -> dict[str, float]:
    """Per edit layer, the fraction of directions the projector of ``constraint`` at ``gamma`` keeps free."""
    return {n: float(p.kept_fraction) for n, p in constraint.projectors(list(layers), gamma).items()}


def gradient_shares(model, tokenizer, requests, layers, projectors: dict, wrappers: list[str]) -> dict:
    """``{wrapper: {setting: mean share}}``: for each edit of ``requests``, the gradient of its target's loss (the
    question rendered by the evaluation wrapper, the target teacher-forced after it) with respect to the edit
    layers' weights, and the share of its squared norm each setting's projectors (``projectors[setting]``: layer
    name -> projector) keep, averaged over the edits (float32). What of the direction an edit needs under a
    wrapper a round may still follow: the kept fraction of directions counts eigenpairs, this weighs them by
    what the edits ask for — an unseen wrapper's (``qa``) beside the trained ones'."""
    import torch

    from crispedit.evaluation.wild import EVAL_WRAPPERS

    weights = {n: m.weight for n, m in layers.items()}
    was = {n: w.requires_grad for n, w in weights.items()}
    sums = {w: dict.fromkeys(projectors, 0.0) for w in wrappers}
    try:
        for w in weights.values():
            w.requires_grad_(True)
        for name in wrappers:
            wrap = EVAL_WRAPPERS[name]
            for req in requests:
                prompt = wrap.render(tokenizer, req.prompt)
                answer = ("" if wrap.chat_template else " ") + req.target
                p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
                a_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
                ids = torch.tensor([p_ids + a_ids])
                labels = torch.tensor([[-100] * len(p_ids) + a_ids])
                model.zero_grad(set_to_none=True)
                model(input_ids=ids, labels=labels).loss.backward()
                grads = {n: w.grad.detach().float() for n, w in weights.items()}
                total = sum(float((g * g).sum()) for g in grads.values())
                for setting, proj in projectors.items():
                    keep = sum(float(proj[n].project(g).pow(2).sum()) for n, g in grads.items())
                    sums[name][setting] += keep / total if total > 0 else 0.0
    finally:
        model.zero_grad(set_to_none=True)
        for n, w in weights.items():
            w.requires_grad_(was[n])
    return {w: {s: round(v / len(requests), 4) for s, v in per.items()} for w, per in sums.items()}


def room(
    model,
    tokenizer,
    requests,
    layers,
    config,
    cap,
    chunk: int,
    rows: list[str],
    edit_gammas: list[float],
    on_round=None,
    wrappers: list[str] = (),
) -> dict:
    """``{"<rows>@<edit γ>": [mean kept fraction before round 1, before round 2, …]}``: the first entry is the
    capability constraint alone (round 1's), entry k the constraint after k rounds' edit factors; ``on_round(out)``
    after every round with the series so far. With ``wrappers``, also ``out["gradient_share"][k]`` for the rounds
    from 2 on: :func:`gradient_shares` of round k's edits under each setting's constraint before round k, and under
    the capability constraint alone (``capability``: the room those edits would have as a round 1 or a batch)."""
    from crispedit.sessions.sequential import accumulate, combine_factors, round_edit_factors

    def mean(d: dict) -> float:
        return round(sum(d.values()) / len(d), 4)

    gamma = config.edit.gamma
    first = mean(kept(cap, layers, gamma))
    out = {f"{r}@{g:g}": [first] for r in rows for g in edit_gammas}
    shares = {}
    acc = dict.fromkeys(rows)
    rounds = [requests[i : i + chunk] for i in range(0, len(requests), chunk)]
    for k, reqs in enumerate(rounds[:-1], start=1):  # the last round's factors constrain no later round
        projectors = {"capability": cap.projectors(list(layers), gamma)} if wrappers else {}
        for r in rows:
            acc[r] = accumulate(
                acc[r], round_edit_factors(model, tokenizer, reqs, layers, config.edit, k, progress=False, rows=r)
            )
            for g in edit_gammas:
                merged = combine_factors(cap, acc[r], config.weighting, config.mix, g)
                out[f"{r}@{g:g}"].append(mean(kept(merged, layers, gamma)))
                if wrappers:
                    projectors[f"{r}@{g:g}"] = merged.projectors(list(layers), gamma)
        if wrappers:
            shares[str(k + 1)] = gradient_shares(model, tokenizer, rounds[k], layers, projectors, list(wrappers))
            out["gradient_share"] = shares
        if on_round is not None:
            on_round(out)
    return out


def table(series: dict) -> str:
    """One markdown row per setting, one column per round; with gradient shares, one table of them per round."""
    kept_rows = {k: v for k, v in series.items() if k != "gradient_share"}
    n = max(len(v) for v in kept_rows.values())
    lines = ["| setting | " + " | ".join(f"r{i + 1}" for i in range(n)) + " |", "|" + "---|" * (n + 1)]
    lines += [f"| {k} | " + " | ".join(f"{x:.2f}" for x in v) + " |" for k, v in kept_rows.items()]
    for k, per in series.get("gradient_share", {}).items():
        wrappers = list(per)
        lines += ["", f"round {k}'s edits: share of their gradient kept", ""]
        lines += ["| setting | " + " | ".join(wrappers) + " |", "|" + "---|" * (len(wrappers) + 1)]
        for setting in per[wrappers[0]]:
            lines.append(f"| {setting} | " + " | ".join(f"{per[w][setting]:.3f}" for w in wrappers) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = stream_parser(__doc__)
    ap.add_argument("--rows", default="full,target", help="edit-factor positions to try (full, target)")
    ap.add_argument("--edit-gammas", help="comma list of edit γs to try (default: the session default)")
    ap.add_argument("--json", help="write the series here (rewritten after every round)")
    ap.add_argument(
        "--mix",
        type=float,
        help="the edit factors' share of the mix whose eigenbasis both sets are masked in (default: the session "
        "default)",
    )
    ap.add_argument(
        "--gradient-share",
        default="",
        metavar="WRAPPERS",
        help="comma list of evaluation wrappers (qa,chat,none): also the share of each later round's edit gradients "
        "under them that each setting keeps",
    )
    args = ap.parse_args()
    from crispedit.atomic import atomic_write_json
    from crispedit.data import load_edits
    from crispedit.editing import EditConfig, SeqConfig
    from crispedit.editing.api import edit_factors
    from crispedit.editing.registry import get_editor
    from crispedit.models import load_model

    rows = [r for r in args.rows.split(",") if r]
    config = SeqConfig(edit=EditConfig(method="crispedit"), **({} if args.mix is None else {"mix": args.mix}))
    config.validate()
    gammas = [float(g) for g in (args.edit_gammas or str(config.edit_gamma)).split(",") if g]
    path, offset, n = slice_arg(args.edits)
    model, tok = load_model(args.model)
    requests = load_edits(path, limit=n, offset=offset)
    editor = get_editor("crispedit")
    layers = editor.select_layers(model, config.edit)
    cap, _ = edit_factors(model, tok, editor, layers, config.edit, progress=False)
    t0 = time.perf_counter()

    def save(series: dict) -> None:
        """Rewrite ``--json`` with the series so far."""
        if args.json:
            record = stream_record(
                args,
                requests,
                config=config.to_json(),
                kept={k: v for k, v in series.items() if k != "gradient_share"},
                **({"gradient_share": series["gradient_share"]} if "gradient_share" in series else {}),
                seconds=round(time.perf_counter() - t0, 1),
                command="python " + " ".join(sys.argv),
            )
            atomic_write_json(args.json, record)

    wrappers = [w for w in args.gradient_share.split(",") if w]
    series = room(model, tok, requests, layers, config, cap, args.chunk, rows, gammas, on_round=save, wrappers=wrappers)
    save(series)
    print(table(series))


if __name__ == "__main__":
    main()
