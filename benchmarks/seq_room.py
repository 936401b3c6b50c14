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

``--gradient-share qa,chat,none`` weighs the kept directions by what each later round's edits need under those
wrappers (:func:`gradient_shares`); ``--weightings each,apart --sweeps 1,2`` adds the other factor weightings;
``--exposure`` the capability and earlier-edit curvature a projected step spends (:func:`curvature_exposure`), the
protection a setting buys with the room it takes.

    python benchmarks/seq_room.py --edits ../shared/data/edits/zsre_dev.json:200:200 --chunk 100 --rows full \\
        --edit-gammas 0.8,0.5 --weightings each,apart --gradient-share qa --exposure --json runs/apart.json

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

EXTRA = ("gradient_share", "exposure")  # the series' entries that are not a setting's kept fractions


def kept(constraint, layers, gamma: float) -> dict[str, float]:
    """Per edit layer, the fraction of directions the projector of ``constraint`` at ``gamma`` keeps free."""
    return {n: float(p.kept_fraction) for n, p in constraint.projectors(list(layers), gamma).items()}


def edit_gradients(model, tokenizer, requests, layers, wrapper: str):
    """For each edit of ``requests``: the gradient (float32, per edit layer name) of its target's loss, the question
    rendered by the evaluation ``wrapper``, the target teacher-forced after it. The weights' ``requires_grad`` is
    left as it was and their ``.grad`` cleared."""
    import torch

    from crispedit.evaluation.wild import EVAL_WRAPPERS

    weights = {n: m.weight for n, m in layers.items()}
    was = {n: w.requires_grad for n, w in weights.items()}
    wrap = EVAL_WRAPPERS[wrapper]
    try:
        for w in weights.values():
            w.requires_grad_(True)
        for req in requests:
            prompt = wrap.render(tokenizer, req.prompt)
            answer = ("" if wrap.chat_template else " ") + req.target
            p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            a_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([p_ids + a_ids])
            labels = torch.tensor([[-100] * len(p_ids) + a_ids])
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=labels).loss.backward()
            yield {n: w.grad.detach().float() for n, w in weights.items()}
    finally:
        model.zero_grad(set_to_none=True)
        for n, w in weights.items():
            w.requires_grad_(was[n])


def gradient_measures(
    model, tokenizer, requests, layers, projectors: dict, wrappers: list[str], curvatures: dict | None = None
) -> tuple[dict, dict]:
    """``(shares, exposure)`` from one gradient pass per wrapper and one projection per gradient and setting:
    :func:`gradient_shares` under ``wrappers`` and, with ``curvatures``, :func:`curvature_exposure` under the QA
    wrapper (``{}`` without)."""
    passes = list(wrappers) + (["qa"] if curvatures and "qa" not in wrappers else [])
    shares = {w: dict.fromkeys(projectors, 0.0) for w in wrappers}
    exposure = {s: dict.fromkeys(curvatures, 0.0) for s in projectors} if curvatures else {}
    for name in passes:
        for grads in edit_gradients(model, tokenizer, requests, layers, name):
            total = sum(float((g * g).sum()) for g in grads.values())
            costs = bool(exposure) and name == "qa"  # this pass also measures the curvature a step spends
            raw = (
                {c: sum(f.quadratic_form(n, g) for n, g in grads.items()) for c, f in curvatures.items()}
                if costs
                else {}
            )
            for setting, proj in projectors.items():
                step = {n: proj[n].project(g) for n, g in grads.items()}
                if name in shares:
                    keep = sum(float(d.pow(2).sum()) for d in step.values())
                    shares[name][setting] += keep / total if total > 0 else 0.0
                if costs:
                    for c, f in curvatures.items():
                        q = sum(f.quadratic_form(n, d) for n, d in step.items())
                        exposure[setting][c] += q / raw[c] if raw[c] > 0 else 0.0

    def mean(sums: dict) -> dict:
        return {a: {b: round(v / len(requests), 4) for b, v in per.items()} for a, per in sums.items()}

    return mean(shares), mean(exposure)


def gradient_shares(model, tokenizer, requests, layers, projectors: dict, wrappers: list[str]) -> dict:
    """``{wrapper: {setting: mean share}}``: for each edit of ``requests``, its :func:`edit_gradients` under each
    wrapper and the share of its squared norm each setting's projectors (``projectors[setting]``: layer
    name -> projector) keep, averaged over the edits (float32). What of the direction an edit needs under a
    wrapper a round may still follow: the kept fraction of directions counts eigenpairs, this weighs them by
    what the edits ask for — an unseen wrapper's (``qa``) beside the trained ones'."""
    return gradient_measures(model, tokenizer, requests, layers, projectors, wrappers)[0]


def curvature_exposure(model, tokenizer, requests, layers, projectors: dict, curvatures: dict) -> dict:
    """``{setting: {curvature: mean ratio}}``: for each edit of ``requests``, its :func:`edit_gradients` ``g`` under
    the QA wrapper and, per setting, the curvature quadratic form of the projected step over the raw one's,
    ``Σ_layers q(P g) / Σ_layers q(g)`` for each named curvature of ``curvatures`` (e.g. the capability factors and
    the earlier rounds' edit factors; ``quadratic_form`` in float64), averaged over the edits. Per unit of
    learning rate, what a setting lets the step cost what that curvature protects: 1 for no projection, near 0
    when the projector masks that curvature's energy."""
    return gradient_measures(model, tokenizer, requests, layers, projectors, [], curvatures)[1]


def setting_name(rows: str, edit_gamma: float, weighting: str, default: str, sweeps: int = 0) -> str:
    """A setting's key: ``<rows>@<edit γ>`` under the session's default ``weighting``, else with ``:<weighting>``
    (``:apart<sweeps>`` for the alternating one)."""
    key = f"{rows}@{edit_gamma:g}"
    if weighting == default:
        return key
    return key + (f":apart{sweeps}" if weighting == "apart" else f":{weighting}")


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
    weightings: list[str] | None = None,
    sweeps: list[int] = (2,),
    exposure: bool = False,
) -> dict:
    """``{setting: [mean kept fraction before round 1, before round 2, …]}`` for every setting (:func:`setting_name`
    of the rows × edit γs × ``weightings``, each ``apart`` once per entry of ``sweeps``; ``weightings`` default to
    the config's): the first entry is the capability constraint alone (round 1's), entry k the constraint after k
    rounds' edit factors; ``on_round(out)`` after every round with the series so far. With ``wrappers``, also
    ``out["gradient_share"][k]`` for the rounds from 2 on: :func:`gradient_shares` of round k's edits under each
    setting's constraint before round k, and under the capability constraint alone (``capability``: the room those
    edits would have as a round 1 or a batch); with ``exposure`` as well, ``out["exposure"][k]``:
    :func:`curvature_exposure` of those edits under the QA wrapper, for the capability factors, the earlier
    rounds' edit factors (``edits``: the first row's) and, when ``target`` is another of the rows, their factors at
    the target positions alone (``edit targets``: the curvature of the earlier edits' own answers, what their
    retention spends; the full rows add the prompts' language-model curvature)."""
    from crispedit.sessions.sequential import accumulate, combine_factors, round_edit_factors

    def mean(d: dict) -> float:
        return round(sum(d.values()) / len(d), 4)

    gamma = config.edit.gamma
    weightings = list(weightings or [config.weighting])
    plan = [(w, k) for w in weightings for k in (sweeps if w == "apart" else [0])]  # (weighting, alternation sweeps)
    first = mean(kept(cap, layers, gamma))
    out = {setting_name(r, g, w, config.weighting, k): [first] for r in rows for g in edit_gammas for w, k in plan}
    shares, exposures = {}, {}
    acc = dict.fromkeys(rows)
    rounds = [requests[i : i + chunk] for i in range(0, len(requests), chunk)]
    for k, reqs in enumerate(rounds[:-1], start=1):  # the last round's factors constrain no later round
        projectors = {"capability": cap.projectors(list(layers), gamma)} if wrappers else {}
        for r in rows:
            acc[r] = accumulate(
                acc[r], round_edit_factors(model, tokenizer, reqs, layers, config.edit, k, progress=False, rows=r)
            )
            for g in edit_gammas:
                for w, n_sweeps in plan:
                    merged = combine_factors(cap, acc[r], w, config.mix, g)
                    if w == "apart":
                        merged.part_sweeps = n_sweeps
                    name = setting_name(r, g, w, config.weighting, n_sweeps)
                    built = merged.projectors(list(layers), gamma)
                    out[name].append(mean({n: p.kept_fraction for n, p in built.items()}))
                    if wrappers:
                        projectors[name] = built
        if wrappers:
            curv = {"capability": cap, "edits": acc[rows[0]]} if exposure else None
            if exposure and "target" in rows[1:]:
                curv["edit targets"] = acc["target"]
            shares[str(k + 1)], cost = gradient_measures(
                model, tokenizer, rounds[k], layers, projectors, list(wrappers), curv
            )
            out["gradient_share"] = shares
            if exposure:
                exposures[str(k + 1)] = cost
                out["exposure"] = exposures
        if on_round is not None:
            on_round(out)
    return out


def table(series: dict) -> str:
    """One markdown row per setting, one column per round; with gradient shares, one table of them per round."""
    kept_rows = {k: v for k, v in series.items() if k not in EXTRA}
    n = max(len(v) for v in kept_rows.values())
    lines = ["| setting | " + " | ".join(f"r{i + 1}" for i in range(n)) + " |", "|" + "---|" * (n + 1)]
    lines += [f"| {k} | " + " | ".join(f"{x:.2f}" for x in v) + " |" for k, v in kept_rows.items()]
    for k, per in series.get("gradient_share", {}).items():
        wrappers = list(per)
        lines += ["", f"round {k}'s edits: share of their gradient kept", ""]
        lines += ["| setting | " + " | ".join(wrappers) + " |", "|" + "---|" * (len(wrappers) + 1)]
        for setting in per[wrappers[0]]:
            lines.append(f"| {setting} | " + " | ".join(f"{per[w][setting]:.3f}" for w in wrappers) + " |")
    for k, per in series.get("exposure", {}).items():
        curv = list(next(iter(per.values())))
        lines += ["", f"round {k}'s edits (qa): curvature of the projected step over the raw step's", ""]
        lines += ["| setting | " + " | ".join(curv) + " |", "|" + "---|" * (len(curv) + 1)]
        lines += [f"| {s} | " + " | ".join(f"{v[c]:.4f}" for c in curv) + " |" for s, v in per.items()]
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
    ap.add_argument(
        "--weightings",
        help="comma list of factor weightings to try (each, apart, …; default: the session default); apart once "
        "per --sweeps entry",
    )
    ap.add_argument("--sweeps", default="2", help="comma list of alternation sweeps for --weightings apart")
    ap.add_argument(
        "--exposure",
        action="store_true",
        help="with --gradient-share: also the capability and earlier-edit curvature each setting lets the QA "
        "wrapper's edit gradients cost",
    )
    args = ap.parse_args()
    from crispedit.versions import source_commit

    source_commit()  # the commit at the start: the record names the code that ran, not one committed meanwhile
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
                kept={k: v for k, v in series.items() if k not in EXTRA},
                **{k: series[k] for k in EXTRA if k in series},
                seconds=round(time.perf_counter() - t0, 1),
                command="python " + " ".join(sys.argv),
            )
            atomic_write_json(args.json, record)

    wrappers = [w for w in args.gradient_share.split(",") if w]
    series = room(
        model,
        tok,
        requests,
        layers,
        config,
        cap,
        args.chunk,
        rows,
        gammas,
        on_round=save,
        wrappers=wrappers,
        weightings=[w for w in (args.weightings or "").split(",") if w] or None,
        sweeps=[int(k) for k in args.sweeps.split(",") if k],
        exposure=args.exposure,
    )
    save(series)
    print(table(series))


if __name__ == "__main__":
    main()
