"""Projection overhead per fast-path edit step, relative to a plain FT step (same model, same batches, one run).

    python benchmarks/bench_projection.py [--model smollm2|tiny|tiny-small|SPEC] [--batch 32] [--repeats 5] [--profile]

Times the steps of the real edit loop (``projected_finetune``, the exact fast path ``crispedit edit`` runs,
default edit contexts) for ft, crispedit with gradient projection (the default; each layer's projector in the
form it picks, see ``--form``) and crispedit with update projection: every repeat runs ``--epochs`` epochs of
each from the same weights with a fresh Adam, interleaved so machine noise hits all alike, through a
``StepTimer`` placed in the loop (``crispedit.editing.steptimer``; free when off). Prints the median step of
each, the overhead per fast-path step ``(crispedit step - ft step) / ft step`` (median of per-repeat pairs) with
PASS/FAIL against the issue's 5 %, and with ``--profile`` the per-phase breakdown (forward, backward, projection,
optimizer, other; ms and % of the step). ``--torch-profile`` adds a ``torch.profiler`` table of one crispedit
run, the loop's phases as ``crispedit.<phase>`` ranges. ``--model tiny`` is a random SmolLM2-shaped 8-block
llama (seconds to minutes), ``tiny-small`` the same at widths 64/128; ``--factors FILE`` builds the projectors
from a K-FAC cache file (e.g. SmolLM2's real factors on ``tiny``).

    python benchmarks/bench_projection.py --flops [--decays 0.5,1,1.5,2] [--gamma 0.8] [--cache FILE --layer NAME]

No model: the projector's cost at Llama-3-8B ``down_proj`` shapes (``d_out`` 4096, ``d_in`` 14336) against
an analytic count of one fwd+bwd edit step (``--edits`` x ``--tokens`` tokens through ``--blocks``
blocks; hidden 4096, intermediate 14336, 32 heads / 8 KV heads, vocabulary 128256), for factors whose
eigenvalues follow power laws ``k^-decay`` (or, with ``--cache``, the spectrum of a real layer's factors
rescaled to these sizes), then a one-layer timing of the full against the low-rank form at
``--time-shape``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from crispedit.curvature.masks import energy_keep_mask, masked_corner, row_extents
from crispedit.curvature.projection import KroneckerProjector, kronecker_projection_flops, staircase_projection_flops
from crispedit.data import BUNDLED_EDITS, bundled_path, load_edits
from crispedit.editing import EditConfig, capability_factors, get_editor
from crispedit.layers import resolve_layers
from crispedit.models import load_model
from crispedit.pipeline import environment

# Llama-3-8B (config.json of meta-llama/Meta-Llama-3-8B)
LLAMA3_8B = dict(hidden=4096, inter=14336, heads=32, kv_heads=8, vocab=128256)


def llama_step_flops(
    n_seq: int,
    seq_len: int,
    blocks: int,
    *,
    hidden: int,
    inter: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    edited: int,
) -> dict:
    """FLOPs (a multiply-add counts 2) of one edit step of a Llama block stack: forward of ``blocks`` blocks
    on ``n_seq`` sequences of ``seq_len`` tokens, and the backward an edit runs with every weight frozen but
    ``edited`` ``down_proj`` matrices (``hidden x inter``): activation gradients through every block above
    the lowest (the lowest edited ``down_proj`` is its block's last matmul, so nothing below it is
    differentiated) plus the edited weights' gradients. Attention scores and values are counted over the
    full ``seq_len x seq_len`` square (an upper bound for causal kernels; < 0.1 % of the total here).
    ``head`` is the LM head's forward plus its input gradient (the fast path runs it on every step)."""
    tokens = n_seq * seq_len
    kv = hidden * kv_heads // heads
    matmul = 2 * tokens * (hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter)  # q, o, k, v; gate, up, down
    attn = 2 * 2 * n_seq * seq_len * seq_len * hidden  # Q K^T and A V, all heads
    fwd = blocks * (matmul + attn)
    bwd = (blocks - 1) * (matmul + 2 * attn) + edited * 2 * tokens * hidden * inter
    head = 2 * 2 * tokens * hidden * vocab
    return {"tokens": tokens, "forward": fwd, "backward": bwd, "step": fwd + bwd, "head": head}


def power_law(n: int, decay: float) -> torch.Tensor:
    """``k^-decay`` for ``k = 1..n`` (float64, decreasing)."""
    return torch.arange(1, n + 1, dtype=torch.float64) ** -decay


def rescaled(lam: torch.Tensor, n: int) -> torch.Tensor:
    """A decreasing spectrum of any length resampled to ``n`` values: ``log lambda`` interpolated at the
    same fractional ranks ``(k + 1/2) / n`` (float64, decreasing)."""
    import numpy as np

    lam = lam.to(torch.float64).sort(descending=True).values
    lam = lam.clamp_min(float(lam[0]) * 1e-30)
    src = (np.arange(len(lam)) + 0.5) / len(lam)
    dst = (np.arange(n) + 0.5) / n
    return torch.from_numpy(np.exp(np.interp(dst, src, np.log(lam.numpy()))))


def _spectra(args, d_out: int, d_in: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(label, lambda_out, lambda_in)`` for every spectrum asked for, at ``d_out`` / ``d_in`` values."""
    out = [(f"power {d:g}", power_law(d_out, d), power_law(d_in, d)) for d in args.decays]
    if args.cache:
        from crispedit.curvature.cache import load_factors
        from crispedit.curvature.masks import eigh_psd

        f = load_factors(args.cache)
        name = args.layer or f.layers[len(f.layers) // 2]
        lam_in, lam_out = eigh_psd(f.A[name])[0], eigh_psd(f.S[name])[0]
        out.append((f"cache {name}", rescaled(lam_out, d_out), rescaled(lam_in, d_in)))
    return out


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def flops_main(args) -> None:
    """``--flops``: projector FLOPs at Llama-3-8B down_proj shapes vs an analytic edit step, then a one-layer
    timing of both forms at ``--time-shape`` (see the module docstring)."""
    d_out, d_in = LLAMA3_8B["hidden"], LLAMA3_8B["inter"]
    step = llama_step_flops(args.edits, args.tokens, args.blocks, edited=args.blocks, **LLAMA3_8B)
    print(
        f"Llama-3-8B edit step: {args.edits} edits x {args.tokens} tokens through {args.blocks} blocks, "
        f"{args.blocks} down_proj ({d_out}x{d_in}) trained: fwd {step['forward'] / 1e12:.3f} + bwd "
        f"{step['backward'] / 1e12:.3f} = {step['step'] / 1e12:.3f} TFLOP (LM head fwd+bwd {step['head'] / 1e12:.3f} "
        "more)"
    )
    full_one = kronecker_projection_flops(d_out, d_in, d_out, d_in)[1]
    print(
        f"full projector: {full_one / 1e12:.3f} TFLOP per layer, x{args.blocks} = "
        f"{args.blocks * full_one / step['step']:.2f} x the step; gamma={args.gamma}"
    )
    rows = []
    print(
        f"{'spectrum':24} {'masked':>8} {'r_out':>6} {'r_in':>6} {'split':>6} {'form':>8} {'1-corner':>9} "
        f"{'low/full':>9} {'TFLOP/layer':>11} {'proj/step':>10} {'w/ head':>8}"
    )
    for label, lo, li in _spectra(args, d_out, d_in):
        keep = energy_keep_mask(torch.outer(lo, li), args.gamma)
        r_out, r_in = masked_corner(keep)
        one_corner = kronecker_projection_flops(d_out, d_in, r_out, r_in)[0]
        low, full, split = staircase_projection_flops(d_out, d_in, row_extents(keep))
        used = min(low, full)
        row = {
            "spectrum": label,
            "masked_fraction": 1 - float(keep.double().mean()),
            "r_out": r_out,
            "r_in": r_in,
            "split": split,
            "one_corner_ratio": one_corner / full,
            "form": "low_rank" if low < full else "full",
            "flop_ratio": low / full,
            "tflop_per_layer": used / 1e12,
            "proj_over_step": args.blocks * used / step["step"],
            "proj_over_step_with_head": args.blocks * used / (step["step"] + step["head"]),
        }
        rows.append(row)
        print(
            f"{label:24} {row['masked_fraction']:8.3g} {r_out:6d} {r_in:6d} {split:6d} {row['form']:>8} "
            f"{row['one_corner_ratio']:9.4f} {row['flop_ratio']:9.4f} "
            f"{row['tflop_per_layer']:11.4f} {row['proj_over_step']:10.4f} {row['proj_over_step_with_head']:8.4f}"
        )
        del keep
    # one layer, timed: both forms on the same projector (random orthogonal eigenbases, the same spectra)
    t_out, t_in = args.time_shape
    g = torch.Generator().manual_seed(0)
    U_out = torch.linalg.qr(torch.randn(t_out, t_out, generator=g))[0]
    U_in = torch.linalg.qr(torch.randn(t_in, t_in, generator=g))[0]
    Q = torch.randn(t_out, t_in, generator=g)
    timings = []
    print(f"one {t_out}x{t_in} layer, float32, {torch.get_num_threads()} thread(s), median of {args.repeats}:")
    for label, lo, li in _spectra(args, t_out, t_in):
        keep = energy_keep_mask(torch.outer(lo, li), args.gamma)
        full = KroneckerProjector(U_out, U_in, keep, form="full")
        auto = KroneckerProjector(U_out, U_in, keep)
        err = float((auto.project(Q) - full.project(Q)).abs().max() / Q.abs().max())
        tf = _median_seconds(lambda full=full: full.project(Q), args.repeats)
        ta = _median_seconds(lambda auto=auto: auto.project(Q), args.repeats)
        timings.append(
            {
                "spectrum": label,
                **auto.stats(),
                "full_ms": tf * 1e3,
                "auto_ms": ta * 1e3,
                "speedup": tf / ta if ta > 0 else float("inf"),
                "max_rel_diff": err,
            }
        )
        t = timings[-1]
        print(
            f"  {label:24} r_out={auto.r_out:5d} r_in={auto.r_in:5d} form={t['form']:8} full {t['full_ms']:8.2f} ms  "
            f"chosen {t['auto_ms']:8.2f} ms  (x{t['speedup']:.1f}; flop ratio {t['flop_ratio']:.4f}; max |diff| "
            f"{err:.1e} of max |Q|)"
        )
    print(
        json.dumps(
            {
                "args": {k: v for k, v in vars(args).items()},
                "step_flops": step,
                "rows": rows,
                "timings": timings,
                "environment": environment(),
            }
        )
    )


KINDS = ("ft/gradient", "crispedit/gradient", "crispedit/update")
TINY_SMALL = dict(hidden=64, inter=128, heads=4, kv_heads=2, vocab=512, tok_vocab=512)
OVERHEAD_GOAL = 0.05  # the target: projection overhead per fast-path step <= 5 % on CPU


def load_bench_model(args):
    """``(model, tokenizer, layer pattern or None)`` for ``--model``: ``tiny`` (random SmolLM2-shaped llama,
    ``--tiny-blocks`` blocks, 5 ``down_proj`` layers as in bench_kfac), ``tiny-small`` (the same with widths 64 /
    128 and a 512-token vocabulary: seconds) or any spec of :func:`crispedit.models.load_model`."""
    if args.model in ("tiny", "tiny-small"):
        import importlib.util
        from pathlib import Path

        spec = importlib.util.spec_from_file_location("bench_kfac", Path(__file__).resolve().parent / "bench_kfac.py")
        kfac = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(kfac)
        widths = TINY_SMALL if args.model == "tiny-small" else {}
        model, tok = kfac.build_tiny(args.tiny_blocks, **widths)
        if args.device:
            model.to(args.device)
        first = max(0, min(2, args.tiny_blocks - 5))
        last = min(args.tiny_blocks - 1, first + 4)
        return model, tok, args.layers or f"model.layers.{{{first}-{last}}}.mlp.down_proj"
    model, tok = load_model(args.model, device=args.device)
    return model, tok, args.layers


def profile_steps(
    model,
    tok,
    layers: dict,
    factors,
    requests,
    *,
    kinds=KINDS,
    repeats: int = 5,
    epochs: int = 1,
    discard: int = 1,
    contexts: str = "default",
    form: str = "auto",
    lr: float | None = None,
    torch_profile: str | None = None,
    torch_profile_rows: int = 30,
) -> dict:
    """Time the steps of the real edit loop (:func:`crispedit.editing.loop.projected_finetune`, fast path) for
    each kind ``"<method>/<projection target>"``, interleaved: every repeat runs ``epochs`` epochs of each
    kind from the same starting weights with a fresh Adam (``skip_loss = stop_loss = 0``, so every kind takes
    the same steps on the same batches), with a :class:`~crispedit.editing.steptimer.StepTimer` in the loop.
    The first ``discard`` steps of every run (Adam's state allocation) are left out. ``torch_profile`` (a kind):
    one more run of it under ``torch.profiler`` with the phases as ``record_function`` ranges; its table of
    operators by self CPU time is ``out["torch_profile"]``.

    Returns ``{"kinds": {kind: {"step_seconds": median over repeats of the run's mean step (s),
    "runs": [mean step per repeat (s)], "breakdown": StepTimer.breakdown pooled over every kept step of every
    repeat (mean seconds per phase), "fast_loss": bool}}, "projectors": {layer: stats}, "steps_per_run": int,
    "sequences": int, "tokens": int}``. The weights are restored afterwards."""
    from crispedit.editing.loop import projected_finetune
    from crispedit.editing.steptimer import StepTimer

    device = next(model.parameters()).device
    configs, projs, params = {}, {}, {}
    for kind in kinds:
        method, target = kind.split("/")
        # the preservation term off for every kind: the same steps apart from the projection, whose cost this measures
        configs[kind] = EditConfig(
            method=method,
            projection_target=target,
            contexts=contexts,
            epochs=epochs,
            skip_loss=0.0,
            stop_loss=0.0,
            lr=lr,
            keep_chat=0,
            keep_subject=0,
        )
        editor = get_editor(method)
        pr = editor.projectors(layers, factors, configs[kind])
        if form == "full":
            pr = {
                n: KroneckerProjector(p.U_out, p.U_in, p.mask, form="full") if isinstance(p, KroneckerProjector) else p
                for n, p in pr.items()
            }
        projs[kind] = {n: p.to(device) for n, p in pr.items()}
        params[kind] = editor.trainable(layers)
    originals = {n: p.detach().clone() for n, p in next(iter(params.values())).items()}

    def restore():
        with torch.no_grad():
            for ps in params.values():
                for n, p in ps.items():
                    p.copy_(originals[n])

    record_functions = False

    def run(kind: str) -> tuple[StepTimer, object]:
        timer = StepTimer(device, record_functions=record_functions)
        restore()
        hist = projected_finetune(
            model, tok, requests, layers, params[kind], projs[kind], configs[kind], progress=False, timer=timer
        )
        return timer, hist

    try:
        for kind in kinds:  # warm-up
            run(kind)
        timers = {k: [] for k in kinds}
        hists = {}
        for _ in range(repeats):
            for kind in kinds:
                timer, hists[kind] = run(kind)
                timers[kind].append(timer)
        table = None
        if torch_profile:  # one more run of the last kind under torch.profiler, phases as record_function ranges
            from torch.profiler import ProfilerActivity, profile

            record_functions = True
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=acts) as prof:
                run(torch_profile)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=torch_profile_rows)
    finally:
        restore()
    out = {"kinds": {}, "projectors": {n: p.stats() for n, p in projs[kinds[-1]].items()}, "torch_profile": table}
    for kind in kinds:
        pooled = StepTimer()
        runs = []
        for t in timers[kind]:
            kept = t.steps[discard:]
            pooled.steps.extend(kept)
            if kept:
                runs.append(sum(r["step"] for r in kept) / len(kept))
        out["kinds"][kind] = {
            "step_seconds": statistics.median(runs) if runs else float("nan"),
            "runs": runs,
            "breakdown": pooled.breakdown(),
            "fast_loss": hists[kind].fast_loss,
        }
    h = hists[kinds[0]]
    out.update(steps_per_run=h.steps, sequences=h.sequences, tokens=h.tokens, contexts=h.contexts)
    return out


def overheads(res: dict, base: str = "ft/gradient") -> dict:
    """Projection overhead of every kind against ``base`` from :func:`profile_steps`' result, two ways:
    ``paired`` = median over repeats of ``(mean step of the kind) / (mean step of base in the same repeat) - 1``
    (runs adjacent in time, so slow spells of a shared machine cancel), and ``attributed`` = the difference of the
    phases other than forward and backward (projection, optimizer, other, unaccounted: the work the methods do
    differently), per step, over the base step (forward and backward do the same work for every kind, so their
    noise is left out). Returns ``{kind: {"paired": float, "attributed": float}}``."""
    ks = res["kinds"]
    ref_runs, ref = ks[base]["runs"], ks[base]["breakdown"]

    def extra(b: dict) -> float:
        return b["step"] - b["forward"] - b["backward"]

    out = {}
    for k, r in ks.items():
        pairs = [a / b - 1 for a, b in zip(r["runs"], ref_runs)]
        out[k] = {
            "paired": statistics.median(pairs) if pairs else float("nan"),
            "attributed": (extra(r["breakdown"]) - extra(ref)) / ref["step"]
            if ref and r["breakdown"]
            else float("nan"),
        }
    return out


def print_overhead(over: dict, goal: float = OVERHEAD_GOAL) -> None:
    """The issue's figure: crispedit/gradient's paired overhead per fast-path step with PASS/FAIL against
    ``goal``, and the overhead attributed to its own phases (:func:`overheads`)."""
    o = over.get("crispedit/gradient")
    if o is None:
        return
    print(
        f"overhead per fast-path step (crispedit gradient projection vs ft): {100 * o['paired']:+.1f} % "
        f"(goal <= {100 * goal:.0f} %): {'PASS' if o['paired'] <= goal else 'FAIL'}; attributed to projection, "
        f"optimizer and other: {100 * o['attributed']:+.1f} %"
    )
    if abs(o["paired"] - o["attributed"]) > goal:
        print("  (the two differ by more than the goal: machine noise in forward/backward; use more --repeats)")


def print_profile(res: dict, base: str = "ft/gradient", goal: float = OVERHEAD_GOAL) -> dict:
    """Print the per-phase breakdown of every kind (ms and % of the step), the median steps and the projection
    overhead of each kind against ``base`` (:func:`overheads`), with PASS/FAIL of crispedit/gradient's
    measured (paired) overhead against ``goal``. Returns :func:`overheads`' dict."""
    rows = ("forward", "backward", "projection", "optimizer", "other", "unaccounted")
    kinds = list(res["kinds"])
    print(
        f"per-phase breakdown of one fast-path step (mean over {res['kinds'][kinds[0]]['breakdown'].get('steps', 0)} "
        f"steps; ms and % of the step):"
    )
    print(f"  {'phase':12}" + "".join(f" {k:>26}" for k in kinds))
    for r in rows + ("step",):
        cells = []
        for k in kinds:
            b = res["kinds"][k]["breakdown"]
            v = b.get(r, float("nan"))
            cells.append(f"{v * 1e3:12.2f} ms {100 * v / b['step'] if b else float('nan'):8.1f} %")
        print(f"  {r:12}" + "".join(f" {c:>26}" for c in cells))
    for k in kinds:
        parts = res["kinds"][k]["breakdown"].get("other_parts", {})
        if parts:
            print(f"  other[{k}]: " + ", ".join(f"{n} {v * 1e3:.3f} ms" for n, v in parts.items()))
    over = overheads(res, base)
    ref = res["kinds"][base]["step_seconds"]
    for k in kinds:
        s = res["kinds"][k]["step_seconds"]
        print(
            f"{k:20} median step {s * 1e3:9.1f} ms   ratio to ft {s / ref:.3f}   paired overhead "
            f"{100 * over[k]['paired']:+6.1f} %   attributed to its own phases {100 * over[k]['attributed']:+6.1f} %"
        )
    print_overhead(over, goal)
    return over


def factors_from_file(path: str, layers: dict) -> object:
    """K-FAC factors of a cache file for the bench ``layers``: by name when the file holds them all, else the
    file's layers in order mapped onto ``layers`` in order (same count; every ``A`` must be ``d_in x d_in`` and
    ``S`` ``d_out x d_out`` of its layer), e.g. SmolLM2's real factors on the SmolLM2-shaped ``tiny`` model, to
    time the projector of a real spectrum without running the real model."""
    from crispedit.curvature.cache import load_factors
    from crispedit.curvature.factors import KFACFactors
    from crispedit.layers import weight_matrix

    f = load_factors(path)
    names = list(layers)
    if all(n in f.A for n in names):
        return f
    if len(f.layers) != len(names):
        raise SystemExit(f"--factors: {path} holds {len(f.layers)} layers, the bench edits {len(names)}")
    A, S = {}, {}
    for src, dst in zip(f.layers, names):
        d_out, d_in = weight_matrix(layers[dst]).shape
        if tuple(f.A[src].shape) != (d_in, d_in) or tuple(f.S[src].shape) != (d_out, d_out):
            raise SystemExit(f"--factors: {src} of {path} does not fit {dst} ({d_out}x{d_in})")
        A[dst], S[dst] = f.A[src], f.S[src]
    return KFACFactors(A, S, f.n_tokens, dict(f.meta))


def step_main(args) -> None:
    """The step benchmark of :func:`main` (no ``--flops``): the real loop's steps for ft and crispedit,
    interleaved; with ``--profile`` the per-phase breakdown too."""
    torch.set_num_threads(args.threads) if args.threads else None
    model, tok, pattern = load_bench_model(args)
    device = next(model.parameters()).device
    layers = resolve_layers(model, pattern)
    cfg = EditConfig(n_cap=args.n_cap, max_len=args.max_len)
    with tempfile.TemporaryDirectory(prefix="bench_projection_") as tmp:  # a random tiny model's factors: not cached
        root = tmp if args.model.startswith("tiny") else None
        factors = (
            factors_from_file(args.factors, layers)
            if args.factors
            else capability_factors(model, tok, layers, cfg, progress=False, cache_root=root)[0]
        )
    reqs = (load_edits(bundled_path(BUNDLED_EDITS)) * 4)[: args.batch]
    res = profile_steps(
        model,
        tok,
        layers,
        factors,
        reqs,
        repeats=args.repeats,
        epochs=args.epochs,
        discard=args.discard,
        contexts=args.contexts,
        form=args.form,
        torch_profile="crispedit/gradient" if args.torch_profile else None,
    )
    print(
        f"model={args.model} layers={len(layers)} requests={args.batch} contexts={','.join(res['contexts'])} "
        f"sequences={res['sequences']} tokens/epoch={res['tokens']} steps/run={res['steps_per_run']} "
        f"threads={torch.get_num_threads()} device={device} fast_loss={res['kinds']['ft/gradient']['fast_loss']}"
    )
    if args.profile:
        over = print_profile(res)
    else:
        over = overheads(res)
        ref = res["kinds"]["ft/gradient"]["step_seconds"]
        for k, r in res["kinds"].items():
            print(
                f"{k:20} median step {r['step_seconds'] * 1e3:9.1f} ms   ratio to ft {r['step_seconds'] / ref:.3f}   "
                f"paired overhead {100 * over[k]['paired']:+6.1f} %"
            )
        print_overhead(over)
    if res["torch_profile"]:
        print("torch.profiler, one crispedit/gradient run (crispedit.<phase> = the loop's phases):")
        print(res["torch_profile"])
    for n, st in res["projectors"].items():
        print(
            f"  {n}: kept {st['kept_fraction']:.4f} r_out={st['r_out']} r_in={st['r_in']} form={st['form']} "
            f"flop ratio {st['flop_ratio']:.4f}"
        )
    summary = {
        "args": vars(args),
        "median_step_seconds": {k: r["step_seconds"] for k, r in res["kinds"].items()},
        "overhead": over,
        "overhead_goal": OVERHEAD_GOAL,
        "pass": over["crispedit/gradient"]["paired"] <= OVERHEAD_GOAL,
        "breakdown": {k: r["breakdown"] for k, r in res["kinds"].items()},
        "runs": {k: r["runs"] for k, r in res["kinds"].items()},
        "projectors": res["projectors"],
        "steps_per_run": res["steps_per_run"],
        "sequences": res["sequences"],
        "tokens": res["tokens"],
        "environment": environment(),
    }
    print(json.dumps(summary))


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _shape(text: str) -> tuple[int, int]:
    a, _, b = text.lower().partition("x")
    return int(a), int(b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (default), tiny (random SmolLM2-shaped llama, --tiny-blocks blocks), tiny-small "
        "(the same, widths 64/128: seconds) or any model spec",
    )
    ap.add_argument("--tiny-blocks", type=int, default=8)
    ap.add_argument(
        "--layers", default=None, help="layer pattern (default: the model's; tiny: 5 down_proj from block 2)"
    )
    ap.add_argument("--batch", type=int, default=32, help="edit requests (each one sequence per edit context)")
    ap.add_argument("--contexts", default="default", help="edit contexts of the requests (EditConfig.contexts)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--epochs", type=int, default=1, help="epochs per timed run (each run starts from the same weights)"
    )
    ap.add_argument("--discard", type=int, default=1, help="first steps of every run left out (Adam state allocation)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="per-phase breakdown of the step (forward, backward, projection, optimizer, other)",
    )
    ap.add_argument(
        "--torch-profile",
        action="store_true",
        help="also one crispedit/gradient run under torch.profiler: operators by self CPU time",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--factors",
        default=None,
        help="K-FAC cache file to build the projectors from instead of collecting (mapped onto the layers "
        "in order when the names differ; e.g. SmolLM2's real factors with --model tiny)",
    )
    ap.add_argument("--n-cap", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256, help="tokens per capability text of the factors")
    ap.add_argument("--device", default=None)
    ap.add_argument(
        "--form",
        choices=["auto", "full"],
        default="auto",
        help="projector form of the crispedit rows (auto: the cheaper of low-rank and full per layer)",
    )
    fl = ap.add_argument_group("--flops: Llama-3-8B shapes, no model")
    fl.add_argument("--flops", action="store_true", help="projector FLOPs vs an analytic edit step, one-layer timing")
    fl.add_argument("--gamma", type=float, default=0.8)
    fl.add_argument("--decays", type=_floats, default=[0.5, 1.0, 1.5, 2.0], help="power-law exponents of both spectra")
    fl.add_argument("--cache", default=None, help="also the spectrum of a real factor file, rescaled")
    fl.add_argument("--layer", default=None, help="layer of --cache (default: the middle one)")
    fl.add_argument("--edits", type=int, default=32)
    fl.add_argument("--tokens", type=int, default=30, help="tokens per edit sequence")
    fl.add_argument("--blocks", type=int, default=5, help="blocks run per step = edited down_proj layers")
    fl.add_argument("--time-shape", type=_shape, default=(512, 1792), help="d_outxd_in of the timed layer")
    args = ap.parse_args()
    if args.flops:
        return flops_main(args)
    return step_main(args)


if __name__ == "__main__":
    main()
