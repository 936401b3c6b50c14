"""N edits x fixed epochs through the real edit engine, phase by phase: what the hardware is asked to do and
how much of it it does.

    python benchmarks/bench_scale.py --random-init smollm2 --synthetic 1000 --device cuda --dtype bfloat16
    python benchmarks/bench_scale.py --random-init llama3-8b --layers 'model.layers.{19-23}.mlp.down_proj' \
        --synthetic 3000 --contexts bare --epochs 25 --device cuda --dtype bfloat16
    python benchmarks/bench_scale.py --model smollm2 --edits ../shared/data/edits/zsre_dev.json --offset 100 \
        --n-edits 32 --epochs 2          # the real model and real edits, on this machine's CPU

Phases, each timed on its own (CUDA-synchronised) and printed as one line:

* ``fingerprint``: the weights hashed for the curvature cache's key (every edit on a model pays it once);
* ``kfac``: the capability K-FAC collection (tokens/s; the factors written to the cache included);
* ``eigh``: the eigendecompositions of the factors (the first edit on a cache pays them);
* ``projector``: a second edit's projector build — factors reloaded from the cache, eigenbases from their cache
  file (:mod:`crispedit.curvature.eigen`), masks;
* ``train``: ``--epochs`` epochs of the projected loop (:func:`crispedit.editing.loop.projected_finetune`, the loop
  every edit runs, ``stop_loss`` 0): s/epoch, s/step, tokens/s, achieved TFLOP/s from counted FLOPs (the
  forward and backward of the blocks above the frozen prefix, the LM head on the target rows, the projection)
  and its fraction of the device's own matmul peak, measured here with a large GEMM of the model dtype;
* ``kfac prof`` (``--profile-kfac``): the collection once more under ``torch.profiler`` (:func:`profile_kfac`): per
  batch the ``aten::`` calls, kernel launches, host reads and synchronisations, and the operators that took the
  most host and device time — where a collection bound by its host spends it (``--kfac-batch-size`` changes the
  batches, not the factors);
* ``profile``: one more epoch (of the first ``--profile-requests`` edits) under ``torch.profiler`` with the loop's
  phases marked: per step, the values read
  back to the host inside a step (``aten::_local_scalar_dense`` outside ``torch.multinomial``'s device-side
  check — on a GPU each is a synchronisation), ``aten::item``, ``aten::nonzero``, explicit
  ``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` calls and device-to-host copies, and the operator
  launches (``aten::`` calls, CUDA kernel launches); reads between steps (once per epoch) are counted apart, and
  so is the skip rule's read on the loop's host path (``skip_reads``: one per step with ``--sync-free off``, the
  CPU default, where it waits for nothing and spares a skipped batch its backward; none on the accelerator's
  path). ``host_syncs`` counts every other read, synchronisation and ``nonzero``: 0 per step on either path.

``--random-init smollm2|llama3-8b`` builds the architecture with random weights (``--blocks K`` keeps K decoder
blocks; without ``--layers`` it edits the real checkpoint's layers where the K blocks hold them, else crispedit's
default layers for K blocks) and a byte-level BPE tokenizer trained in-process on the bundled WikiText sample, with a
ChatML chat
template like SmolLM2's: timings only, no quality. ``--synthetic N`` makes up N facts (no data files needed).
``--json FILE`` writes every figure with the arguments and the environment. A ``--method`` entry may end in
``:bf16`` (training precision), ``:tf32`` (the projection's GEMMs), ``:compile`` or ``:graphs`` (the decoder
blocks under ``torch.compile``, the latter with CUDA graphs: its first run compiles, a second is timed).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from crispedit.atomic import atomic_write_json
from crispedit.curvature.eigen import eigh_device, factor_eigh
from crispedit.data import EditRequest, load_edits
from crispedit.editing import EditConfig, get_editor
from crispedit.editing.api import capability_factors
from crispedit.editing.config import PROJECTION_PRECISIONS
from crispedit.editing.fastpath import may_pack, pack_if_it_pays, prefix_sharing
from crispedit.editing.loop import edit_batches, projected_finetune
from crispedit.editing.steptimer import StepTimer
from crispedit.errors import CrispEditError
from crispedit.layers import decoder_blocks, default_layer_pattern, expand_pattern
from crispedit.models import load_model
from crispedit.progress import progress_lines
from crispedit.versions import environment
from crispedit.weights import restoring, weight_fingerprint

# Architectures of the real checkpoints (their config.json), for random-init runs
SHAPES = {
    "smollm2": dict(
        hidden=576,
        inter=1536,
        heads=9,
        kv_heads=3,
        vocab=49152,
        blocks=30,
        tied=True,
        rope=100000.0,
        layers="model.layers.{4-8}.mlp.down_proj",
    ),
    "llama3-8b": dict(
        hidden=4096,
        inter=14336,
        heads=32,
        kv_heads=8,
        vocab=128256,
        blocks=32,
        tied=False,
        rope=500000.0,
        layers="model.layers.{19-23}.mlp.down_proj",
    ),
}
CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
    "AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _bench_kfac():
    spec = importlib.util.spec_from_file_location("bench_kfac", Path(__file__).resolve().parent / "bench_kfac.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def random_model(shape: str, blocks: int | None, dtype: torch.dtype, device: str):
    """``(model, tokenizer)``: the architecture of ``shape`` (:data:`SHAPES`) with random weights, ``blocks`` decoder
    blocks (default: all), in ``dtype`` on ``device``; the tokenizer is a byte-level BPE of the bundled WikiText
    with SmolLM2's ChatML chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPES[shape]
    tok = _bench_kfac().build_bpe_tokenizer(8192)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=blocks or s["blocks"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=4096,
        tie_word_embeddings=s["tied"],
        rms_norm_eps=1e-5,
        rope_theta=s["rope"],
    )
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    return load_model((model, tok), device=device)


def random_init_layers(shape: str, model) -> str:
    """The ``--layers`` default of a ``--random-init`` run: the real checkpoint's layers of ``shape`` (:data:`SHAPES`)
    when ``model``'s blocks hold them all, else crispedit's default layers for its depth
    (:func:`~crispedit.layers.default_layer_pattern`: a ``--blocks`` model too shallow for the real ones)."""
    pattern = SHAPES[shape]["layers"]
    modules = dict(model.named_modules())
    return pattern if all(name in modules for name in expand_pattern(pattern)) else default_layer_pattern(model)


def synthetic_requests(n: int, seed: int = 0) -> list[EditRequest]:
    """``n`` made-up facts (``"Which river flows through Tavrolen 17?"`` -> ``"Marsiq Delune"``), deterministic in
    ``seed``: question lengths and target lengths like ZsRE's."""
    rng = random.Random(seed)
    syl = ["ta", "vro", "len", "mar", "siq", "de", "lune", "ko", "ra", "bel", "thi", "on", "qua", "zer", "os"]
    word = lambda k: "".join(rng.choice(syl) for _ in range(k)).capitalize()  # noqa: E731
    asks = [
        "Which river flows through {}?",
        "Who founded {}?",
        "In which country is {} located?",
        "What is the native language of {}?",
        "Which company produced {}?",
        "Who is the author of {}?",
    ]
    out = []
    for i in range(n):
        subject = f"{word(2)} {i}"
        out.append(
            EditRequest(rng.choice(asks).format(subject), f"{word(2)} {word(rng.randint(1, 3))}", subject=subject)
        )
    return out


def matmul_peak(dtype: torch.dtype, device: str) -> float:
    """The device's matmul throughput in ``dtype`` (TFLOP/s): the best of several ``n x n`` GEMMs (``n`` 8192 on a
    GPU, 2048 on a CPU)."""
    n = 8192 if device.startswith("cuda") else 2048
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e12


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def step_flops(model, batches, params, projectors, packed=None) -> float:
    """FLOPs (a multiply-add counts 2) of one epoch over ``batches``: for every batch, the forward of the decoder
    blocks above the frozen prefix (the lowest block holding a trained weight) on every position it computes (the
    ``B x T`` padded batch, or the ``R x L`` layout of its entry in ``packed`` where given and not ``None``: shared
    prefixes computed once; every matmul of the block and attention's two ``T x T`` products), their activation
    backward, the trained weights' gradients, the LM head on the target rows (forward + input gradient), and the
    projections."""
    cfg = model.config
    h, inter, heads = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    kv = h * cfg.num_key_value_heads // heads
    block_params = h * (2 * h + 2 * kv) + 3 * h * inter
    _, blocks = decoder_blocks(model)
    trained = {id(p) for p in params.values()}
    owners = [i for i, b in enumerate(blocks) if any(id(p) in trained for p in b.parameters())]
    above = len(blocks) - (min(owners) if owners else 0)
    proj = sum(
        getattr(pr, "flops_low_rank" if getattr(pr, "low_rank", False) else "flops_full", 0)
        for pr in projectors.values()
    )
    total = 0.0
    for b, p in zip(batches, packed or [None] * len(batches)):
        n, T = (p if p is not None else b.input_ids).shape
        tokens = n * T
        attn = 2 * 2 * n * T * T * h
        fwd = above * (2 * tokens * block_params + attn)
        bwd = above * (2 * tokens * block_params + 2 * attn) + sum(2 * tokens * p.numel() for p in params.values())
        targets = sum(b.target_lengths)
        total += fwd + bwd + 2 * 2 * targets * h * cfg.vocab_size + proj
    return total


def profile_epoch(
    model, tok, requests, layers, params, projectors, config, device: str, sync_free: bool | None = None
) -> dict:
    """Counts of one more epoch under ``torch.profiler`` (phases marked by a :class:`StepTimer`): per step and
    between steps (:func:`_tally`); ``host_syncs_per_step`` (reads, ``nonzero`` and synchronisations in a step,
    the skip rule's host read apart) and ``skip_reads_per_step`` (that read: 1 on the host path, 0 sync-free)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    timer = StepTimer(None, record_functions=True)
    one = EditConfig(**{**config.to_json(), "epochs": 1})
    with profile(activities=acts) as prof:
        hist = projected_finetune(
            model, tok, requests, layers, params, projectors, one, progress=False, timer=timer, sync_free=sync_free
        )
    steps = max(1, hist.steps + hist.skipped)
    inside, outside = _tally(
        prof, lambda name, parents: any(p.startswith("crispedit.") for p in parents) or name.startswith("crispedit.")
    )
    per_step = {k: round(v / steps, 3) for k, v in inside.items()}
    per_step["host_syncs"] = round((inside["reads"] + inside["nonzero"] + inside["sync_calls"]) / steps, 3)
    return {
        "steps": steps,
        "per_step": per_step,
        "between_steps": outside,
        "host_syncs_per_step": per_step["host_syncs"],
        "skip_reads_per_step": per_step["skip_reads"],
    }


def _tally(prof, inside_of) -> tuple[dict, dict]:
    """Counts of a ``torch.profiler`` run's events, split by ``inside_of(name, parent names)``: values read back
    to the host (``reads``: ``aten::_local_scalar_dense`` outside ``aten::_assert_async``; ``skip_reads`` those
    of the loop's ``crispedit.skip_read`` phase, the skip rule read on the host), ``item``, ``nonzero``, explicit
    synchronisations, device-to-host copies, CUDA kernel launches and top-level ``aten::`` calls (one not
    nested in another)."""
    inside = {
        "reads": 0,
        "skip_reads": 0,
        "item": 0,
        "nonzero": 0,
        "sync_calls": 0,
        "dtoh": 0,
        "aten_ops": 0,
        "kernel_launches": 0,
    }
    outside = dict(inside)

    def chain(e):
        out, p = [], e.cpu_parent
        while p is not None:
            out.append(p.name)
            p = p.cpu_parent
        return out

    for e in prof.events():
        name = e.name
        parents = chain(e)
        where = inside if inside_of(name, parents) else outside
        if name == "aten::_local_scalar_dense" and "aten::_assert_async" not in parents:
            where["skip_reads" if "crispedit.skip_read" in parents else "reads"] += 1
        elif name == "aten::item" and "aten::_assert_async" not in parents:
            where["item"] += 1
        elif name == "aten::nonzero":
            where["nonzero"] += 1
        elif name in SYNC_CALLS:
            where["sync_calls"] += 1
        elif "DtoH" in name or "Device -> Pageable" in name:
            where["dtoh"] += 1
        elif name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel"):
            where["kernel_launches"] += 1
        if name.startswith("aten::") and not any(p.startswith("aten::") for p in parents):
            where["aten_ops"] += 1
    return inside, outside


def profile_kfac(model, tok, layers, config, device: str, top: int = 12) -> dict:
    """One more K-FAC collection (the capability corpus of ``config``, not cached) under ``torch.profiler``: its
    batches and seconds, per batch the host reads, synchronisations, ``aten::`` calls and kernel launches
    (:func:`_tally`), and the ``top`` operators by self CPU time and, on a GPU, by self device time (each
    ``(name, calls, milliseconds)``), so a collection bound by the host shows where its time goes."""
    from torch.profiler import ProfilerActivity, profile

    from crispedit.curvature.kfac import collect_lm_kfac
    from crispedit.data.corpus import capability_corpus

    texts = capability_corpus(config.cap_corpus, config.n_cap)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    _sync(device)
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        factors = collect_lm_kfac(
            model,
            tok,
            texts,
            layers,
            max_len=config.max_len,
            batch_size=config.kfac_batch_size,
            label_mode=config.label_mode,
            seed=config.seed,
            progress=False,
        )
        _sync(device)
    seconds = time.perf_counter() - t
    counts, _ = _tally(prof, lambda name, parents: True)
    n_batches = sum(1 for e in prof.events() if e.name == "crispedit.kfac.statistics")  # one range per batch
    per_batch = {k: round(v / max(1, n_batches), 1) for k, v in counts.items()}
    ev = prof.key_averages()

    def ranked(attr):
        rows = sorted(ev, key=lambda e: getattr(e, attr, 0) or 0, reverse=True)[:top]
        return [(e.key, e.count, round((getattr(e, attr, 0) or 0) / 1e3, 2)) for e in rows if getattr(e, attr, 0)]

    out = {
        "batches": n_batches,
        "tokens": factors.n_tokens,
        "seconds": round(seconds, 3),
        "per_batch": per_batch,
        "top_self_cpu": ranked("self_cpu_time_total"),
    }
    if device.startswith("cuda"):
        out["top_self_device"] = ranked("self_device_time_total")
    return out


@contextlib.contextmanager
def compiled_blocks(model, mode: str | None):
    """While active, every decoder block of ``model`` is ``torch.compile(block, mode=mode, dynamic=True)`` (the
    same parameters: the loop trains them as before); ``mode=None`` changes nothing. An experiment for issue
    37 (e): a step of small batches on a GPU is bound by its host's operator launches, which compiled blocks
    (and, with ``"reduce-overhead"``, CUDA graphs) cut."""
    if mode is None:
        yield
        return
    _, blocks = decoder_blocks(model)
    saved = list(blocks)
    try:
        for i, b in enumerate(saved):
            blocks[i] = torch.compile(b, mode=mode, dynamic=True)
        yield
    finally:
        for i, b in enumerate(saved):
            blocks[i] = b


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="a model spec of crispedit (default smollm2 unless --random-init)")
    src.add_argument("--random-init", choices=sorted(SHAPES), default=None)
    ap.add_argument(
        "--blocks",
        type=int,
        default=None,
        help="random init: keep this many decoder blocks (without --layers: the real checkpoint's edit "
        "layers where they fit, else crispedit's default layers for this depth)",
    )
    data = ap.add_mutually_exclusive_group()
    data.add_argument("--synthetic", type=int, default=None, metavar="N", help="N made-up facts")
    data.add_argument("--edits", default=None, help="an edit file (with --offset / --n-edits)")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--n-edits", type=int, default=32)
    ap.add_argument(
        "--method",
        default="crispedit",
        help="a method, or several separated by commas (each trains from the same weights; the last is "
        "the reference of the printed step-time ratios, e.g. crispedit,ft); METHOD:bf16 trains "
        "that entry with --precision bf16, METHOD:tf32 with --projection-precision tf32, "
        "METHOD:bf16+tf32 both (e.g. crispedit:bf16,crispedit), METHOD:compile / :graphs with "
        "compiled decoder blocks, METHOD:noshare without shared-prefix packing",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--layers", default=None)
    ap.add_argument("--contexts", default="default")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--batch-tokens", type=int, default=None, help="pack batches to N padded tokens instead")
    ap.add_argument(
        "--projection-precision",
        choices=PROJECTION_PRECISIONS,
        default="fp32",
        help="the projection's GEMMs on a GPU (EditConfig.projection_precision)",
    )
    ap.add_argument("--n-cap", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument(
        "--kfac-batch-size",
        type=int,
        default=EditConfig.kfac_batch_size,
        help="texts per K-FAC batch (the factors do not depend on it)",
    )
    ap.add_argument(
        "--profile-kfac",
        action="store_true",
        help="collect the K-FAC factors once more under torch.profiler: per batch counts, top operators",
    )
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled epoch")
    ap.add_argument(
        "--profile-requests",
        type=int,
        default=64,
        metavar="N",
        help="the profiled epoch runs the first N edits (default 64): per-step counts need a few steps, "
        "and the profiler's events of a whole large epoch take minutes to read",
    )
    ap.add_argument(
        "--sync-free",
        choices=("auto", "on", "off"),
        default="auto",
        help="the loop's skip rule on the device (on; the accelerator default) or read on the host "
        "(off; the CPU default, where a read is free and a skipped batch's backward is saved)",
    )
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    if args.blocks is not None and args.blocks < 1:
        ap.error(f"--blocks must be at least 1, got {args.blocks}")
    return args


def run_method(method: str, args, model, tok, requests, layers_pattern, device: str, peak: float, root: str) -> dict:
    """Every phase of one method (:func:`main`'s lines; ``method`` may end in ``:bf16`` / ``:fp32`` (the training
    precision), ``:tf32`` (the projection's GEMMs), ``:compile`` / ``:graphs`` (the decoder blocks under
    ``torch.compile``, :func:`compiled_blocks`), ``:noshare`` (no shared-prefix packing, every batch padded),
    joined by ``+``), the model's trained weights restored afterwards
    (:func:`restored`, also when the entry fails)."""
    name, _, suffix = method.partition(":")
    modes = set(suffix.split("+")) - {""}
    if modes - {"bf16", "fp32", "tf32", "compile", "graphs", "noshare"}:
        raise SystemExit(
            f"bench_scale: unknown method suffix in {method!r} (bf16, fp32, tf32, compile, graphs, "
            "noshare, joined by +)"
        )
    share = "noshare" not in modes
    compile_mode = "reduce-overhead" if "graphs" in modes else "default" if "compile" in modes else None
    config = EditConfig(
        method=name,
        precision="bf16" if "bf16" in modes else "fp32",
        layers=layers_pattern,
        epochs=args.epochs,
        stop_loss=0.0,
        contexts=args.contexts,
        batch_size=args.batch_size,
        batch_tokens=args.batch_tokens,
        projection_precision="tf32" if "tf32" in modes else args.projection_precision,
        n_cap=args.n_cap,
        max_len=args.max_len,
        kfac_batch_size=args.kfac_batch_size,
    ).validate()
    editor = get_editor(config.method)
    layers = editor.select_layers(model, config)
    params = editor.trainable(layers)
    out: dict = {"layers": list(layers)}
    with restoring(params):  # the next entry (or a failed one) leaves the weights as they were
        print(f"[{method}] {len(layers)} layers ({layers_pattern})")
        if editor.needs_curvature:
            t = time.perf_counter()
            fingerprint = weight_fingerprint(model)  # the cache key's model part: every weight's bytes hashed once
            fp_s = time.perf_counter() - t
            out["fingerprint"] = {"seconds": round(fp_s, 3)}
            print(f"fingerprint{fp_s:8.2f} s  (the weights hashed for the curvature cache key, once per edit)")
            _sync(device)
            t = time.perf_counter()
            factors, info = capability_factors(
                model,
                tok,
                layers,
                config,
                cache_root=root,
                progress=False,
                kind=editor.curvature_kind,
                fingerprint=fingerprint,
            )
            _sync(device)
            kfac_s = time.perf_counter() - t
            out["kfac"] = {
                "seconds": round(kfac_s, 3),
                "tokens": factors.n_tokens,
                "cache_hit": info["hit"],
                "tokens_per_s": round(factors.n_tokens / kfac_s, 1),
            }
            print(
                f"kfac       {kfac_s:8.2f} s  {factors.n_tokens} tokens  {factors.n_tokens / kfac_s:,.0f} tokens/s"
                + ("  (cache hit)" if info["hit"] else "")
            )
            t = time.perf_counter()
            factor_eigh(
                factors, layers, ("A", "S") if editor.curvature_kind == "kfac" else ("A",), device=eigh_device(layers)
            )
            eigh_s = time.perf_counter() - t
            out["eigh"] = {"seconds": round(eigh_s, 3)}
            print(f"eigh       {eigh_s:8.2f} s  (first edit on a cache; written beside the factors)")
            t = time.perf_counter()
            factors, _ = capability_factors(
                model,
                tok,
                layers,
                config,
                cache_root=root,
                progress=False,
                kind=editor.curvature_kind,
                fingerprint=fingerprint,
            )
            reload_s = time.perf_counter() - t
            t = time.perf_counter()
            projectors = editor.projectors(layers, factors, config)
            proj_s = time.perf_counter() - t
            out["projector"] = {"seconds": round(proj_s, 3), "factor_reload_seconds": round(reload_s, 3)}
            print(
                f"projector  {proj_s:8.2f} s  (a second edit: eigenbases from their cache file, masks; the factors' "
                f"reload {reload_s:.2f} s)"
            )
            if args.profile_kfac:
                kp = profile_kfac(model, tok, layers, config, device)
                out["kfac_profile"] = kp
                pb = kp["per_batch"]
                print(
                    f"kfac prof  {kp['seconds']:8.2f} s  {kp['batches']} batches of <= {config.kfac_batch_size} "
                    "texts, "
                    f"{kp['tokens'] / kp['seconds']:,.0f} tokens/s under the profiler; per batch {pb['aten_ops']} "
                    "aten "
                    f"ops, {pb['kernel_launches']} kernel launches, {pb['reads']} reads, {pb['sync_calls']} sync "
                    "calls"
                )
                for key in ("top_self_cpu", "top_self_device"):
                    for op, calls, ms in kp.get(key, []):
                        print(f"           {key[4:]:>9}  {ms:10.1f} ms  {calls:6d} calls  {op}")
        else:
            projectors = editor.projectors(layers, None, config)
        batches, _ = edit_batches(tok, requests, config, model)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        sync_free = {"auto": None, "on": True, "off": False}[args.sync_free]
        with compiled_blocks(model, compile_mode), prefix_sharing(share):
            if compile_mode:  # a first run pays the compilation (its training undone); the timed run shows the step
                with restoring(params):
                    t = time.perf_counter()
                    projected_finetune(
                        model, tok, requests, layers, params, projectors, config, progress=False, sync_free=sync_free
                    )
                    _sync(device)
                    first_s = time.perf_counter() - t
                out["compile"] = {"mode": compile_mode, "first_run_seconds": round(first_s, 3)}
                print(
                    f"compile    {compile_mode}: the first run (compiling) {first_s:.2f} s; the figures below are a "
                    f"second run of the same epochs"
                )
            _sync(device)
            t = time.perf_counter()
            hist = projected_finetune(
                model, tok, requests, layers, params, projectors, config, progress=False, sync_free=sync_free
            )
            _sync(device)
            train_s = time.perf_counter() - t
        # the FLOPs of what ran: packed batches (shared prefixes computed once) counted in their packed layout
        packed = share and hist.extra.get("packed_batches", 0) > 0 and may_pack(model)
        flops = step_flops(
            model,
            batches,
            params,
            projectors,
            packed=[pack_if_it_pays(b.input_ids, b.attention_mask, b.labels) for b in batches] if packed else None,
        )
        epochs = len(hist.epoch_loss)
        steps = hist.steps + hist.skipped
        per_epoch = hist.seconds / epochs
        tflops = flops / per_epoch / 1e12
        out["train"] = {
            "seconds": round(train_s, 3),
            "epochs": epochs,
            "steps": steps,
            "s_per_epoch": round(per_epoch, 4),
            "s_per_step": round(hist.seconds / steps, 5),
            "sequences": hist.sequences,
            "tokens_per_epoch": hist.tokens,
            "positions_per_epoch": hist.extra.get("positions_per_epoch"),
            "padded_per_epoch": hist.extra.get("padded_per_epoch"),
            "packed_batches": hist.extra.get("packed_batches"),
            "tokens_per_s": round(hist.tokens / per_epoch, 1),
            "flops_per_epoch": flops,
            "tflops": round(tflops, 4),
            "fraction_of_peak": round(tflops / peak, 5),
            "fast_loss": hist.fast_loss,
            "skipped_batches": hist.skipped,
            "sync_free": device.startswith("cuda") if sync_free is None else sync_free,
        }
        print(
            f"train      {per_epoch:8.3f} s/epoch  {hist.seconds / steps:.4f} s/step  {steps // epochs} steps/epoch  "
            f"{hist.tokens / per_epoch:,.0f} tokens/s  {tflops:.3f} TFLOP/s = {100 * tflops / peak:.1f} % of peak"
        )
        if hist.extra.get("positions_per_epoch") is not None:
            print(
                f"           {hist.extra['positions_per_epoch']:,} positions computed per epoch of "
                f"{hist.extra['padded_per_epoch']:,} padded ({hist.extra['packed_batches']} batches packed as prefix "
                f"trees)"
            )
        if not args.no_profile:
            with compiled_blocks(model, compile_mode):
                prof = profile_epoch(
                    model, tok, requests[: args.profile_requests], layers, params, projectors, config, device, sync_free
                )
            out["profile"] = prof
            ps = prof["per_step"]
            print(
                f"profile    per step: {ps['host_syncs']} host syncs ({ps['reads']} reads, {ps['nonzero']} nonzero, "
                f"{ps['sync_calls']} sync calls, {ps['dtoh']} DtoH copies), {ps['aten_ops']} aten ops, "
                f"{ps['kernel_launches']} kernel launches; between steps: {prof['between_steps']['reads']} reads "
                f"in {prof['steps']} steps"
            )
            if ps["skip_reads"]:
                print(
                    f"           and {ps['skip_reads']} skip-rule reads per step: the loop's host path (--sync-free "
                    "off, the CPU default) reads the skip test to spare a skipped batch its backward"
                )
        out["peak_memory_mib"] = round(
            (
                torch.cuda.max_memory_allocated()
                if device.startswith("cuda")
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            )
            / 2**20,
            1,
        )
        out["host_syncs_per_step"] = out.get("profile", {}).get("host_syncs_per_step")
        print(
            f"memory     peak {out['peak_memory_mib']:,.0f} MiB "
            f"({'device allocated' if device.startswith('cuda') else 'RSS'})"
        )
    return out


def main(argv=None) -> dict:
    """Run the benchmark (arguments as the command line's); returns what ``--json`` writes: one entry per method
    under ``methods`` (its single method's figures also at the top level) and, for several methods, each one's
    training s/step over the last one's (``step_ratio``)."""
    args = _args(argv)
    dtype = getattr(torch, args.dtype)
    device = args.device
    t = time.perf_counter()
    if args.random_init:
        model, tok = random_model(args.random_init, args.blocks, dtype, device)
        layers_pattern = args.layers or random_init_layers(args.random_init, model)
    else:
        model, tok = load_model(args.model or "smollm2", dtype=args.dtype, device=device)
        layers_pattern = args.layers
    load_s = time.perf_counter() - t
    if args.synthetic is not None:
        requests = synthetic_requests(args.synthetic)
    elif args.edits:
        requests = load_edits(args.edits)[args.offset : args.offset + args.n_edits]
    else:
        requests = synthetic_requests(args.n_edits)
    out: dict = {
        "args": vars(args),
        "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "environment": environment(),
        "n_edits": len(requests),
        "load_seconds": round(load_s, 2),
    }
    peak = matmul_peak(dtype, device)
    out["matmul_peak_tflops"] = round(peak, 3)
    print(
        f"device {out['device_name']} ({args.dtype}): matmul peak {peak:.2f} TFLOP/s; {len(requests)} edits, "
        f"model built/loaded in {load_s:.1f}s"
    )
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    with tempfile.TemporaryDirectory() as root, progress_lines(False):  # the loop's every-5-epochs lines
        out["methods"] = {}
        for m in methods:
            try:
                out["methods"][m] = run_method(m, args, model, tok, requests, layers_pattern, device, peak, root)
            except Exception as e:  # an experimental entry (:compile, :graphs) that fails leaves the others measured
                if not {"compile", "graphs"} & set(m.partition(":")[2].split("+")):
                    raise
                out["methods"][m] = {"error": f"{type(e).__name__}: {e}"[:500]}
                print(f"[{m}] failed: {out['methods'][m]['error']}")
                torch._dynamo.reset()
    if len(methods) == 1:
        out.update(out["methods"][methods[0]])
    else:
        ref = out["methods"][methods[-1]]["train"]["s_per_step"]
        out["step_ratio"] = {
            m: round(r["train"]["s_per_step"] / ref, 4) for m, r in out["methods"].items() if "train" in r
        }
        print("step time / " + methods[-1] + ": " + ", ".join(f"{m} {v:.3f}" for m, v in out["step_ratio"].items()))
    if args.json:
        atomic_write_json(args.json, out)
    return out


if __name__ == "__main__":
    try:
        sys.exit(0 if main() else 1)
    except CrispEditError as exc:  # a layer, an edit file, a setting the library refused: one line
        sys.exit(f"bench_scale: error: {exc}")
