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
) -> dict:
    """``{"<rows>@<edit γ>": [mean kept fraction before round 1, before round 2, …]}``: the first entry is the
    capability constraint alone (round 1's), entry k the constraint after k rounds' edit factors; ``on_round(out)``
    after every round with the series so far."""
    from crispedit.sessions.sequential import accumulate, combine_factors, round_edit_factors

    def mean(d: dict) -> float:
        return round(sum(d.values()) / len(d), 4)

    first = mean(kept(cap, layers, config.edit.gamma))
    out = {f"{r}@{g:g}": [first] for r in rows for g in edit_gammas}
    acc = dict.fromkeys(rows)
    rounds = [requests[i : i + chunk] for i in range(0, len(requests), chunk)]
    for k, reqs in enumerate(rounds[:-1], start=1):  # the last round's factors constrain no later round
        for r in rows:
            acc[r] = accumulate(
                acc[r], round_edit_factors(model, tokenizer, reqs, layers, config.edit, k, progress=False, rows=r)
            )
            for g in edit_gammas:
                merged = combine_factors(cap, acc[r], config.weighting, config.mix, g)
                out[f"{r}@{g:g}"].append(mean(kept(merged, layers, config.edit.gamma)))
        if on_round is not None:
            on_round(out)
    return out


def table(series: dict) -> str:
    """One markdown row per setting, one column per round."""
    n = max(len(v) for v in series.values())
    lines = ["| setting | " + " | ".join(f"r{i + 1}" for i in range(n)) + " |", "|" + "---|" * (n + 1)]
    lines += [f"| {k} | " + " | ".join(f"{x:.2f}" for x in v) + " |" for k, v in series.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = stream_parser(__doc__)
    ap.add_argument("--rows", default="full,target", help="edit-factor positions to try (full, target)")
    ap.add_argument("--edit-gammas", help="comma list of edit γs to try (default: the session default)")
    ap.add_argument("--json", help="write the series here (rewritten after every round)")
    args = ap.parse_args()
    from crispedit.atomic import atomic_write_json
    from crispedit.data import load_edits
    from crispedit.editing import EditConfig, SeqConfig
    from crispedit.editing.api import edit_factors
    from crispedit.editing.registry import get_editor
    from crispedit.models import load_model

    rows = [r for r in args.rows.split(",") if r]
    config = SeqConfig(edit=EditConfig(method="crispedit"))
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
                kept=series,
                seconds=round(time.perf_counter() - t0, 1),
                command="python " + " ".join(sys.argv),
            )
            atomic_write_json(args.json, record)

    series = room(model, tok, requests, layers, config, cap, args.chunk, rows, gammas, on_round=save)
    save(series)
    print(table(series))


if __name__ == "__main__":
    main()
