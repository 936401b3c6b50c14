"""``crispedit demo``: the embedded default job.

SmolLM2-135M-Instruct + the bundled ZsRE sample and WikiText corpus: edit 32 facts with crispedit and
with plain fine-tuning (same layers, optimiser and epochs), print a before/after table of generated
answers and each method's teacher-forced reliability / generalisation and KL drift on held-out text.
"""

from __future__ import annotations

import time

from .data import BUNDLED_EDITS, bundled_path, heldout_text, load_edits
from .editing import EditConfig, edit, restore
from .evaluation import edit_scores, kl_drift, summarize_edit_scores
from .evaluation.generation import generate_answers
from .models import load_model

__all__ = ["run_demo"]


def _short(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def run_demo(n_edits: int = 32, epochs: int = 100, gamma: float = 0.8, n_cap: int = 64, model_spec: str = "smollm2",
             show: int = 6) -> int:
    t0 = time.perf_counter()
    requests = load_edits(bundled_path(BUNDLED_EDITS), limit=n_edits)
    print(f"loading {model_spec} ...", flush=True)
    model, tok = load_model(model_spec)
    print(f"loaded in {time.perf_counter() - t0:.1f}s; editing {len(requests)} ZsRE facts", flush=True)
    shown = requests[:show]
    prompts = [r.prompt for r in shown]
    answers = {"before": generate_answers(model, tok, prompts, max_new_tokens=12)}
    texts = heldout_text(None, 32)
    rows = []
    for method in ("crispedit", "ft"):
        cfg = EditConfig(method=method, gamma=gamma, epochs=epochs, n_cap=n_cap)
        res = edit(model, tok, requests, cfg)
        summ = summarize_edit_scores(edit_scores(model, tok, requests))
        drift = kl_drift(model, tok, texts, base_weights=res.original_weights)
        answers[method] = generate_answers(model, tok, prompts, max_new_tokens=12)
        rows.append((method, summ["rel"], summ["gen"], drift["kl_drift"], drift["ppl"], drift["ppl_base"],
                     len(res.history.epoch_loss), res.edit_seconds, res.cache_seconds,
                     min(v["kept_fraction"] for v in res.projector_stats.values())))
        restore(model, res.original_weights)

    w = 44
    print()
    print(f"{'prompt':{w}} | {'target':18} | {'before':18} | {'crispedit':18} | {'ft':18}")
    print("-" * (w + 4 * 21))
    def cell(method: str, i: int) -> str:
        return _short(answers[method][i] or "<eos>", 18)

    for i, r in enumerate(shown):
        print(f"{_short(r.prompt, w):{w}} | {_short(r.target, 18):18} | {cell('before', i):18} | "
              f"{cell('crispedit', i):18} | {cell('ft', i):18}")
    if any(not a for a in answers["before"]):
        print("<eos>: the model ends its reply at once (the base instruct model does this on a bare question)")
    print()
    print(f"{'method':10} {'rel':>6} {'gen':>6} {'kl_drift':>10} {'ppl':>8} {'epochs':>7} {'edit s':>7} {'cache s':>8} {'kept':>6}")
    for m, rel, gen, kl, ppl, ppl0, ep, es, cs, kept in rows:
        print(f"{m:10} {rel:6.3f} {gen:6.3f} {kl:10.5f} {ppl:8.3f} {ep:7d} {es:7.1f} {cs:8.1f} {kept:6.3f}")
    print(f"\nbase model perplexity on held-out WikiText: {rows[0][5]:.3f}; "
          f"kl_drift = mean per-token KL(base || edited) there. total {time.perf_counter() - t0:.0f}s")
    return 0
