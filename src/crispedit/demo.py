"""``crispedit demo``: the embedded default job — what a user of an instruct model sees.

SmolLM2-135M-Instruct + the bundled ZsRE sample and WikiText corpus: edit 32 facts with crispedit and
with plain fine-tuning (same layers, optimiser, epochs and edit contexts), then show

* a before/after table of the answers the model gives *through its chat template* (how a user asks an
  instruct model; a bare question makes it answer ``<eos>`` before editing, which shows nothing);
* for each method, WILD reliability / generalisation under the qa (the paper's wrapper, never trained),
  none (bare question) and chat contexts (rule judge), teacher-forced reliability, the KL drift on
  held-out text, and what the edit did to the assistant elsewhere (:mod:`crispedit.evaluation.assistant`): the
  length of its chat answers to unrelated prompts over the base's, and the share of other questions about an
  edited subject now answered with its new target.
"""

from __future__ import annotations

import time

from .checks import check_int, check_positive_int
from .data import BUNDLED_EDITS, bundled_path, load_edits
from .editing.config import EditConfig

__all__ = ["run_demo", "chat_answers"]


def _short(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def chat_answers(model, tok, prompts: list[str], max_new_tokens: int = 24) -> list[str]:
    """The model's greedy answers (at most ``max_new_tokens`` tokens each, cut at ".", a newline or EOS) to
    ``prompts`` asked the way a user asks an instruct model: through its chat template (the ``chat``
    evaluation wrapper), or bare for a tokenizer without one. Shared by the demo's before/after table and
    the playground."""
    from .evaluation.generation import generate_answers
    from .evaluation.wild import render_prompt

    wrapper = "chat" if getattr(tok, "chat_template", None) else "none"  # the evaluation wrapper asked through
    rendered = [render_prompt(tok, p, wrapper) for p in prompts]
    return generate_answers(model, tok, rendered, max_new_tokens=max_new_tokens, add_special_tokens=wrapper != "chat")


def run_demo(
    n_edits: int = 6,
    epochs: int = 100,
    gamma: float = 0.8,
    n_cap: int = 16,
    model_spec: str = "smollm2",
    show: int = 6,
    methods: tuple[str, ...] = ("crispedit", "ft"),
    progress: bool | None = None,
    precision: str = "auto",
    kl_texts: int = 16,
) -> int:
    """Run the demo and print its tables; returns the exit status (0). Sized to be short: ``n_edits`` bundled
    edits, ``n_cap`` capability texts for the curvature, a bfloat16 training forward where the hardware has it
    natively (``precision`` ``"auto"``; float32 elsewhere), the drift on ``kl_texts``
    held-out paragraphs; ``crispedit demo --n-edits 32 --n-cap 64 --precision fp32 --kl-texts 32`` is the
    library's defaults at the size of the earlier demo. Every phase prints a line with the seconds
    since the start; where progress bars do not show (output not a terminal) the edit loop and the curvature
    collection add a line every few epochs / per phase (:func:`~crispedit.progress.progress_lines`)."""
    from .progress import progress_lines

    def configs():
        """One :class:`EditConfig` per method (checks every number)."""
        return {m: EditConfig(method=m, gamma=gamma, epochs=epochs, n_cap=n_cap, precision=precision) for m in methods}

    configs()  # every number checked before the model is loaded
    show = check_int("--show", show, 0)
    kl_texts = check_positive_int("--kl-texts", kl_texts)
    t0 = time.perf_counter()
    requests = load_edits(bundled_path(BUNDLED_EDITS), limit=check_positive_int("--n-edits", n_edits))

    def say(msg: str) -> None:
        """Print ``msg`` after the seconds since the start."""
        print(f"[{time.perf_counter() - t0:5.0f} s] {msg}", flush=True)

    with progress_lines(progress):
        rows, answers = _run_methods(model_spec, requests, configs(), requests[:show], progress, say, kl_texts)
    _print_tables(requests[:show], answers, rows, methods)
    print(
        f"\nbase model perplexity on held-out WikiText: {rows[0][5]:.3f}; "
        f"kl_drift = mean per-token KL(base || edited) on {kl_texts} paragraphs there. total "
        f"{time.perf_counter() - t0:.0f}s"
    )
    return 0


def _run_methods(model_spec: str, requests, configs: dict, shown, progress, say, kl_texts: int) -> tuple[list, dict]:
    """Load the model, ask the ``shown`` questions, edit with each config in turn (restoring the base weights
    after each) and evaluate it; the demo's rows and the answers before and after each method."""
    from .editing import restore  # torch: only once every argument is checked
    from .evaluation import EVAL_WRAPPERS
    from .models import load_model
    from .pipeline import EditJob, Measures

    say(f"loading {model_spec} ...")
    model, tok = load_model(model_spec, progress=progress)
    via = "its chat template" if getattr(tok, "chat_template", None) else "the bare question (no chat template)"
    say(f"loaded; editing {len(requests)} ZsRE facts; answers below are asked through {via}")
    prompts = [r.prompt for r in shown]
    answers = {"before": chat_answers(model, tok, prompts)}
    rows = []
    for method, cfg in configs.items():
        say(
            f"editing with {method} (contexts {cfg.contexts}, answer end {cfg.answer_end}, precision {cfg.precision}) "
            "..."
        )
        job = EditJob(model, tok, requests, cfg, Measures(kl_texts=kl_texts), progress)
        res = job.edit()
        ran = res.history.extra.get("precision", cfg.precision)  # what auto / bf16 ran as here
        say(
            f"{method}: edited in {res.edit_seconds:.0f} s ({len(res.history.epoch_loss)} epochs, {ran}); evaluating "
            f"(WILD {', '.join(EVAL_WRAPPERS)}, teacher-forced, KL drift) ..."
        )
        ev = job.evaluate(res.original_weights)
        s = ev["summary"]
        answers[method] = chat_answers(model, tok, prompts)
        rows.append(
            (
                method,
                ev["wild"],
                s["rel"],
                s["kl_drift"],
                s["ppl"],
                s["ppl_base"],
                len(res.history.epoch_loss),
                res.edit_seconds,
                res.history.contexts,
                ev["assistant"],
            )
        )
        restore(model, res.original_weights)
    say("done")
    return rows, answers


def _print_tables(shown, answers: dict, rows: list, methods) -> None:
    """The before/after answers table and the WILD / drift table."""
    from .evaluation import EVAL_WRAPPERS

    w, c = 40, 20
    print()
    print(f"{'question':{w}} | {'new target':{c}} | {'before':{c}} | " + " | ".join(f"{m:{c}}" for m in methods))
    print("-" * (w + (len(methods) + 2) * (c + 3)))
    for i, r in enumerate(shown):
        cells = [_short(answers[k][i] or "<eos>", c) for k in ("before",) + tuple(methods)]
        print(f"{_short(r.prompt, w):{w}} | {_short(r.target, c):{c}} | " + " | ".join(f"{x:{c}}" for x in cells))
    if any(not a for a in answers["before"]):
        print("<eos>: the model ends its reply at once")
    print()
    print("WILD (free generation, greedy, rule judge): rel / gen per context; qa = the paper's wrapper, never trained")
    print(
        f"{'method':10} " + "".join(f"{w:>11} " for w in EVAL_WRAPPERS) + f"{'tf rel':>7} {'kl_drift':>9} {'ppl':>7} "
        f"{'chat len':>8} {'bleed':>5} {'epochs':>6} {'edit s':>7}  contexts"
    )
    for m, wild, rel, kl, ppl, _, ep, es, ctxs, helper in rows:

        def cell(wrapper: str, wild: dict = wild) -> str:
            """``rel/gen`` of this row's WILD evaluation wrapper ``wrapper`` to two decimals, ``-`` if it was not
            run."""
            v = wild.get(wrapper)
            return "-" if not v else f"{v['rel']:.2f}/{v['gen']:.2f}"

        bleed = "-" if not helper["bleed"] else f"{helper['bleed']['target']:.2f}"
        print(
            f"{m:10} " + "".join(f"{cell(w):>11} " for w in EVAL_WRAPPERS) + f"{rel:7.3f} {kl:9.5f} {ppl:7.2f} "
            f"{'x{:.2f}'.format(helper['style']['length_ratio']):>8} {bleed:>5} {ep:6d} {es:7.1f}  {','.join(ctxs)}"
        )
    print(
        "chat len: the edited model's chat answers to unrelated prompts, in tokens, over the base's; bleed: the "
        "share of other questions about an edited subject now answered with its new target"
    )
