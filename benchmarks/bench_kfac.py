"""K-FAC collection throughput against its limit (a bare forward + partial backward) and against a peer
(kronfluence's K-FAC covariance fitting), on the same model, layers and tokens, in one run.

    python benchmarks/bench_kfac.py --tiny                      # random SmolLM2-shaped 8-block llama, seconds
    python benchmarks/bench_kfac.py --model smollm2             # the real SmolLM2-135M (minutes)
    python benchmarks/bench_kfac.py --tiny --profile            # + torch.profiler table of our collection

Three passes over the same texts, interleaved ``--repeats`` times (medians reported), all in
``--label-mode`` (default ``empirical``: kronfluence's ``use_empirical_fisher``):

* **ours**: :func:`crispedit.curvature.kfac.collect_lm_kfac` (tokenisation and batching included).
* **bare**: the same planned batches, frozen parameters, graph cut at the lowest edited layer, LM head
  and loss on the loss positions only: what the collection costs without statistics. Goal: ours/bare
  >= 0.95.
* **kronfluence** (PyPI ``kronfluence``, optional: skipped with a message if it is not importable):
  ``strategy="kfac"`` covariance fitting of the same layers. ``--kf-feed analyzer`` (default) runs its
  public ``Analyzer.fit_covariance_matrices`` on a dataset of the tokenised texts in corpus order, padded
  per batch of ``--batch`` by a collate function, with the language-model task of kronfluence's examples
  (full logits, shifted cross-entropy); ``--kf-feed ours`` feeds it our own planned batches through
  ``fit_covariance_matrices_with_loader`` (like for like: same batches, same padding). Either way the task's
  attention mask is our loss mask (a position counts iff it predicts a real next token), so both sides
  average over the same rows; kronfluence's raw sums are divided by its own counts and compared with our
  factors (max relative Frobenius difference over layers, A and S; must be <= 1e-5). Goal: ours/kronfluence
  >= 2.

Tokens = loss positions (rows of the factors). Config, timings, ratios and environment go out as one JSON
line at the end (``--json PATH`` also writes it to a file).
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from crispedit.curvature.kfac import collect_lm_kfac
from crispedit.curvature.lm_backward import LabelMode, lm_backward, plain_head
from crispedit.curvature.lm_batches import lm_batches
from crispedit.curvature.statistics import frozen
from crispedit.data import bundled_path, capability_corpus
from crispedit.layers import resolve_layers
from crispedit.pipeline import environment

TINY_LAYERS = "model.layers.{2-6}.mlp.down_proj"


def build_bpe_tokenizer(vocab: int = 8192):
    """A byte-level BPE tokenizer of ``vocab`` tokens (``<eos>`` and ``<pad>`` among them) trained in-process on the
    bundled WikiText sample: what random-weight benchmark models tokenise with when no checkpoint is at hand."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = bundled_path("wikitext_capability.txt").read_text().split("\n\n")
    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=["<eos>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>")


def build_tiny(
    n_layers: int = 8,
    seed: int = 0,
    *,
    hidden: int = 576,
    inter: int = 1536,
    heads: int = 9,
    kv_heads: int = 3,
    vocab: int = 49152,
    tok_vocab: int = 8192,
):
    """A random-weight llama with SmolLM2-135M's widths (hidden 576, MLP 1536, 9 heads / 3 KV heads, tied
    49 152-token vocabulary; the keywords change them) but ``n_layers`` blocks, and a byte-level BPE
    tokenizer (``tok_vocab`` tokens, at most ``vocab``) trained in-process on the bundled WikiText sample.
    Returns ``(model, tokenizer)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_bpe_tokenizer(min(tok_vocab, vocab))
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
    )
    model = LlamaForCausalLM(cfg).eval()
    return model, tok


def bare_pass(model, batches, layers, label_mode: LabelMode, seed: int = 0) -> int:
    """Forward + backward down to the lowest of ``layers`` (its output made a leaf, parameters frozen) over
    ``batches``, LM head and loss on the loss positions only, exactly as the collection does
    (:func:`~crispedit.curvature.kfac.lm_backward`), but no statistics; returns the number of rows."""
    lowest = next(iter(layers.values()))
    h = lowest.register_forward_hook(lambda mod, args, out: out.detach().requires_grad_(True))
    n = 0
    skip = list(layers.values())
    try:
        with frozen(model):
            head = plain_head(model, batches[0], skip)
            for b in batches:
                lm_backward(model, b, label_mode, seed, head, skip)
                n += b.n_rows
    finally:
        h.remove()
    return n


# ---------------------------------------------------------------------------------------------
# kronfluence (optional)


def kronfluence_available() -> str | None:
    """None if kronfluence imports, else the reason (one line)."""
    try:
        import kronfluence  # noqa: F401
        from kronfluence.factor.covariance import fit_covariance_matrices_with_loader  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"{type(exc).__name__}: {exc}"
    return None


def make_kf_task(layer_names: list[str], label_mode: LabelMode):
    """kronfluence ``Task`` for next-token loss in the form of kronfluence's language-model examples (full
    ``B x T x V`` logits, shifted summed cross-entropy with ``-100`` on positions without a real next token),
    tracking ``layer_names``, whose attention mask is our loss mask (``rows``)."""
    from kronfluence.task import Task

    class NextTokenTask(Task):
        def compute_train_loss(self, batch, model, sample=False):
            logits = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
            ).logits.float()
            logits = logits[:, :-1].contiguous().view(-1, logits.size(-1))
            if sample:
                with torch.no_grad():
                    labels = torch.multinomial(torch.softmax(logits.detach(), -1), 1).flatten()
                labels = torch.where(batch["rows"][:, :-1].reshape(-1).bool(), labels, -100)
            else:
                labels = batch["labels"][:, 1:].reshape(-1)
            return F.cross_entropy(logits, labels, reduction="sum", ignore_index=-100)

        def compute_measurement(self, batch, model):  # not used by covariance fitting
            return self.compute_train_loss(batch, model)

        def get_influence_tracked_modules(self):
            return list(layer_names)

        def get_attention_mask(self, batch):
            return batch["rows"]

    return NextTokenTask()


def _kf_batch(input_ids, attention_mask, rows) -> dict:
    labels = input_ids.masked_fill(~F.pad(rows[:, :-1], (1, 0)).bool(), -100)  # labels[t+1] kept iff rows[t]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "rows": rows.long(), "labels": labels}


def kf_fit(kf_model, task, layer_names, texts, tok, batches, args, workdir) -> tuple[float, dict, dict]:
    """One kronfluence covariance fit; returns (seconds, A, S) with its raw sums divided by its counts."""
    from kronfluence.arguments import FactorArguments
    from kronfluence.utils.constants import (
        ACTIVATION_COVARIANCE_MATRIX_NAME,
        GRADIENT_COVARIANCE_MATRIX_NAME,
        NUM_ACTIVATION_COVARIANCE_PROCESSED,
        NUM_GRADIENT_COVARIANCE_PROCESSED,
    )

    fargs = FactorArguments(
        strategy="kfac", use_empirical_fisher=args.label_mode == "empirical", covariance_max_examples=None
    )
    if args.kf_feed == "ours":
        from kronfluence.factor.covariance import fit_covariance_matrices_with_loader
        from kronfluence.utils.state import State

        loader = [_kf_batch(b.input_ids, b.attention_mask, b.rows) for b in batches]
        t0 = time.perf_counter()
        _, factors = fit_covariance_matrices_with_loader(
            model=kf_model,
            state=State(cpu=True),
            task=task,
            loader=loader,
            factor_args=fargs,
            tracked_module_names=layer_names,
            disable_tqdm=True,
        )
        seconds = time.perf_counter() - t0
    else:
        from kronfluence.analyzer import Analyzer
        from kronfluence.utils.dataset import DataLoaderKwargs

        ids = tok(list(texts), truncation=True, max_length=args.max_len)["input_ids"]
        pad = tok.pad_token_id

        def collate(items):
            T = max(len(x) for x in items)
            input_ids = torch.tensor([x + [pad] * (T - len(x)) for x in items])
            attn = torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in items])
            rows = torch.zeros_like(attn)
            rows[:, :-1] = attn[:, :-1] * attn[:, 1:]
            return _kf_batch(input_ids, attn, rows)

        analyzer = Analyzer(
            analysis_name="bench", model=kf_model, task=task, cpu=True, disable_tqdm=True, output_dir=workdir
        )
        t0 = time.perf_counter()
        analyzer.fit_covariance_matrices(
            "kfac",
            dataset=ids,
            per_device_batch_size=args.batch,
            factor_args=fargs,
            dataloader_kwargs=DataLoaderKwargs(collate_fn=collate),
            overwrite_output_dir=True,
        )
        seconds = time.perf_counter() - t0
        factors = analyzer.load_covariance_matrices("kfac")
    A = {
        n: (
            factors[ACTIVATION_COVARIANCE_MATRIX_NAME][n].double()
            / factors[NUM_ACTIVATION_COVARIANCE_PROCESSED][n].item()
        )
        for n in layer_names
    }
    S = {
        n: factors[GRADIENT_COVARIANCE_MATRIX_NAME][n].double() / factors[NUM_GRADIENT_COVARIANCE_PROCESSED][n].item()
        for n in layer_names
    }
    return seconds, A, S


def rel_diff(ours, A, S) -> float:
    """Max over layers and over A, S of ``||ours - theirs||_F / ||theirs||_F``."""
    out = 0.0
    for n in A:
        for mine, theirs in ((ours.A[n], A[n]), (ours.S[n], S[n])):
            out = max(out, float((mine.double() - theirs).norm() / theirs.norm()))
    return out


# ---------------------------------------------------------------------------------------------


CATEGORIES = [
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::addmm_")),
    ("attention", ("aten::_scaled_dot_product",)),
    ("softmax / log-softmax", ("aten::_softmax", "aten::_log_softmax", "aten::nll_loss")),
    (
        "copies, fills, gathers",
        (
            "aten::copy_",
            "aten::fill_",
            "aten::zero_",
            "aten::index",
            "aten::_index_put_impl_",
            "aten::cat",
            "aten::clone",
            "aten::contiguous",
            "aten::masked_fill",
        ),
    ),
    (
        "elementwise",
        (
            "aten::mul",
            "aten::add",
            "aten::sub",
            "aten::div",
            "aten::neg",
            "aten::pow",
            "aten::silu",
            "aten::rsqrt",
            "aten::mean",
            "aten::sum",
            "aten::where",
            "aten::exp",
            "aten::sin",
            "aten::cos",
        ),
    ),
]


def profile_breakdown(fn) -> dict[str, float]:
    """Run ``fn()`` under torch.profiler; seconds of self CPU time by operator category (:data:`CATEGORIES`,
    first matching prefix), the total, and the CPU totals of crispedit's ``record_function`` ranges."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    out: dict[str, float] = {name: 0.0 for name, _ in CATEGORIES}
    out["other"] = 0.0
    total = 0.0
    for ev in prof.key_averages():
        sec = ev.self_cpu_time_total / 1e6
        if ev.key.startswith("crispedit."):
            out[ev.key] = out.get(ev.key, 0.0) + ev.cpu_time_total / 1e6
            continue
        total += sec
        cat = next((name for name, prefixes in CATEGORIES if ev.key.startswith(prefixes)), "other")
        out[cat] += sec
    out["total"] = total
    return out


def print_breakdowns(rows: dict[str, dict[str, float]]) -> None:
    """One column per pass, one row per category (seconds and share of the pass's total)."""
    keys = [name for name, _ in CATEGORIES] + ["other", "total"]
    keys += sorted({k for r in rows.values() for k in r if k.startswith("crispedit.")})
    print("profile (self CPU seconds by operator category; crispedit.* = inclusive time of that range)")
    print(f"{'':28s}" + "".join(f"{name:>22s}" for name in rows))
    for k in keys:
        cells = []
        for r in rows.values():
            v = r.get(k)
            cells.append(f"{'-':>22s}" if v is None else f"{v:9.2f} s ({v / r['total']:5.1%})".rjust(22))
        print(f"{k:28s}" + "".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="model spec for crispedit.models.load_model (default smollm2)")
    ap.add_argument("--tiny", action="store_true", help="random SmolLM2-shaped llama with --tiny-blocks blocks instead")
    ap.add_argument("--tiny-blocks", type=int, default=8)
    ap.add_argument(
        "--layers",
        default=None,
        help=f"layer pattern (default: the model's default edit layers; {TINY_LAYERS} with --tiny)",
    )
    ap.add_argument("--n", type=int, default=16, help="number of capability texts")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--max-padding",
        type=float,
        default=0.25,
        help="our batch planner's bound on the padded share of a batch (-1: corpus order)",
    )
    ap.add_argument("--label-mode", default="empirical", choices=["empirical", "sampled"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default=None)
    ap.add_argument(
        "--kf-feed",
        default="analyzer",
        help="comma list of: analyzer (kronfluence's own Analyzer + DataLoader, corpus order), "
        "ours (our planned batches through fit_covariance_matrices_with_loader)",
    )
    ap.add_argument("--no-kronfluence", action="store_true")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after timing, profile one pass of each kind and print where the time goes",
    )
    ap.add_argument("--json", default=None, help="also write the JSON summary to this file")
    args = ap.parse_args()
    max_padding = None if args.max_padding < 0 else args.max_padding
    args.max_padding = max_padding
    feeds = [f.strip() for f in args.kf_feed.split(",") if f.strip()]
    if not feeds or any(f not in ("analyzer", "ours") for f in feeds):
        sys.exit(f"--kf-feed: expected a comma list of analyzer, ours; got {args.kf_feed!r}")
    torch.set_num_threads(args.threads)
    label_mode = LabelMode(args.label_mode)

    if args.tiny:
        model, tok = build_tiny(args.tiny_blocks)
        args.model = f"tiny-smollm2-shaped-{args.tiny_blocks}"
        layers = resolve_layers(model, args.layers or TINY_LAYERS)
    else:
        from crispedit.models import load_model

        model, tok = load_model(args.model, device=args.device)
        layers = resolve_layers(model, args.layers)
    device = next(model.parameters()).device
    texts = capability_corpus(None, args.n)
    names = list(layers)

    why_not = "--no-kronfluence" if args.no_kronfluence else kronfluence_available()
    if why_not:
        print(
            f"kronfluence skipped ({why_not}); install it with: pip install --no-deps kronfluence==1.0.1",
            file=sys.stderr,
        )
        feeds = []
    else:
        import warnings

        from kronfluence.analyzer import prepare_model

        warnings.filterwarnings("ignore", category=FutureWarning, module="kronfluence")
        task = make_kf_task(names, label_mode)
        kf_model = prepare_model(copy.deepcopy(model), task)
    workdir = tempfile.mkdtemp(prefix="bench_kfac_")  # kronfluence's Analyzer writes its factors here
    try:
        _measure(
            args,
            model,
            tok,
            texts,
            layers,
            feeds,
            label_mode,
            device,
            workdir,
            (task, kf_model) if feeds else (None, None),
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _measure(args, model, tok, texts, layers, feeds, label_mode, device, workdir, kf) -> None:
    """The interleaved timing loop, the report and the optional profile of :func:`main`."""
    task, kf_model = kf
    names = list(layers)
    max_padding = args.max_padding
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    planned = lm_batches(
        tok, texts, max_len=args.max_len, batch_size=args.batch, max_padding=max_padding, device=device
    )

    def run_ours():
        return collect_lm_kfac(
            model,
            tok,
            texts,
            layers,
            max_len=args.max_len,
            batch_size=args.batch,
            label_mode=label_mode,
            progress=False,
            max_padding=max_padding,
        )

    def run_bare():
        batches = lm_batches(
            tok, texts, max_len=args.max_len, batch_size=args.batch, max_padding=max_padding, device=device
        )
        return bare_pass(model, batches, layers, label_mode)

    def run_kf(feed):
        return kf_fit(
            kf_model, task, names, texts, tok, planned, argparse.Namespace(**{**vars(args), "kf_feed": feed}), workdir
        )

    # warm-up (allocator, kernels, lazy imports), not timed
    collect_lm_kfac(
        model,
        tok,
        texts[: args.batch],
        layers,
        max_len=args.max_len,
        batch_size=args.batch,
        label_mode=label_mode,
        progress=False,
        max_padding=max_padding,
    )
    bare_pass(model, planned[:1], layers, label_mode)

    times: dict[str, list[float]] = {"ours": [], "bare": [], **{f"kronfluence[{f}]": [] for f in feeds}}
    rel: dict[str, float] = {}
    for _ in range(args.repeats):  # interleaved: a slow spell on a shared machine hits every pass alike
        sync()
        t0 = time.perf_counter()
        ours = run_ours()
        sync()
        times["ours"].append(time.perf_counter() - t0)
        sync()
        t0 = time.perf_counter()
        n_tok = run_bare()
        sync()
        times["bare"].append(time.perf_counter() - t0)
        for f in feeds:
            s, A, S = run_kf(f)
            times[f"kronfluence[{f}]"].append(s)
            if label_mode is LabelMode.EMPIRICAL:
                rel[f] = rel_diff(ours, A, S)
    assert n_tok == ours.n_tokens, (n_tok, ours.n_tokens)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    print(
        f"model={args.model} layers={len(layers)} ({names[0]} ..) texts={args.n} tokens={n_tok} batch={args.batch} "
        f"max_padding={max_padding} label_mode={args.label_mode} threads={args.threads} repeats={args.repeats}"
    )
    print(f"{'pass':24s} {'median s':>9s} {'tokens/s':>9s} {'best s':>9s} {'tokens/s':>9s}")
    for k in times:
        print(f"{k:24s} {med[k]:9.2f} {n_tok / med[k]:9.1f} {best[k]:9.2f} {n_tok / best[k]:9.1f}")
    ratios = {"ours/bare": (med["bare"] / med["ours"], best["bare"] / best["ours"])}
    for f in feeds:
        k = f"kronfluence[{f}]"
        ratios[f"ours/{k}"] = (med[k] / med["ours"], best[k] / best["ours"])
    for k, (m, b_) in ratios.items():
        goal = "goal >= 0.95" if k == "ours/bare" else "goal >= 2"
        print(f"throughput ratio {k:30s} = {m:.3f} (medians)  {b_:.3f} (best runs)   ({goal})")
    for f, r in rel.items():
        print(f"factors vs kronfluence[{f}]: max rel. Frobenius diff over layers, A and S = {r:.2e}  (must be <= 1e-5)")
    out = {"args": vars(args), "tokens": n_tok, "seconds": times, "ratios_median_best": ratios, "factor_rel_diff": rel}
    if args.profile:
        rows = {"ours": profile_breakdown(run_ours), "bare": profile_breakdown(run_bare)}
        for f in feeds:
            rows[f"kronfluence[{f}]"] = profile_breakdown(lambda f=f: run_kf(f))
        print_breakdowns(rows)
        out["profile"] = rows
    out["environment"] = environment()
    line = json.dumps(out, default=str)
    print(line)
    if args.json:
        from crispedit.atomic import atomic_write_bytes

        atomic_write_bytes(args.json, (line + "\n").encode())
    bad = {f: r for f, r in rel.items() if r > 1e-5}
    if bad:
        sys.exit(f"factors disagree with kronfluence: {bad} (> 1e-5)")


if __name__ == "__main__":
    main()
