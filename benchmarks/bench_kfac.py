"""K-FAC collection throughput relative to a bare forward + partial backward over the same tokens.

    python benchmarks/bench_kfac.py [--model smollm2] [--n 16] [--max-len 256] [--batch 8] [--repeats 2]

"Bare" = the same batches, the same frozen parameters and the same graph cut at the lowest hooked
layer (so backward runs down to it only), the same sampled-label loss, but no statistics. Runs are
interleaved; medians, tokens/s and the ratio are printed, with config and environment as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from crispedit.curvature.kfac import collect_lm_kfac, frozen, loss_positions, sample_labels
from crispedit.data import capability_corpus
from crispedit.models import load_model, resolve_layers
from crispedit.pipeline import environment


def bare_pass(model, tok, texts, layers, max_len, batch) -> int:
    device = next(model.parameters()).device
    lowest = next(iter(layers.values()))

    def cut(mod, args, out):
        return out.detach().requires_grad_(True)

    n_tokens = 0
    tok.padding_side = "right"
    with frozen(model):
        h = lowest.register_forward_hook(cut)
        try:
            for i in range(0, len(texts), batch):
                enc = tok(list(texts[i:i + batch]), return_tensors="pt", padding=True, truncation=True, max_length=max_len)
                ids, attn = enc["input_ids"].to(device), enc["attention_mask"].to(device)
                pos = loss_positions(attn)
                logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
                labels = torch.stack([sample_labels(logits[j], 0, i + j) for j in range(ids.shape[0])])
                F.cross_entropy(logits[pos], labels[pos], reduction="sum").backward()
                n_tokens += int(pos.sum())
        finally:
            h.remove()
    return n_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    model, tok = load_model(args.model, device=args.device)
    layers = resolve_layers(model, None)
    texts = capability_corpus(None, args.n)
    sync = torch.cuda.synchronize if next(model.parameters()).device.type == "cuda" else (lambda: None)
    t_kfac, t_bare, n_tok = [], [], 0
    for _ in range(args.repeats):
        sync(); t0 = time.perf_counter()
        f = collect_lm_kfac(model, tok, texts, layers, max_len=args.max_len, batch_size=args.batch, progress=False)
        sync(); t_kfac.append(time.perf_counter() - t0)
        sync(); t0 = time.perf_counter()
        n_tok = bare_pass(model, tok, texts, layers, args.max_len, args.batch)
        sync(); t_bare.append(time.perf_counter() - t0)
    assert n_tok == f.n_tokens
    k, b = statistics.median(t_kfac), statistics.median(t_bare)
    print(f"model={args.model} layers={len(layers)} texts={args.n} tokens={n_tok} batch={args.batch}")
    print(f"K-FAC collection      {k:8.2f} s  {n_tok / k:9.1f} tokens/s")
    print(f"bare fwd+partial bwd  {b:8.2f} s  {n_tok / b:9.1f} tokens/s")
    print(f"throughput ratio (K-FAC / bare) = {b / k:.3f}   (time overhead of statistics: {k / b - 1:+.1%})")
    print(json.dumps({"args": vars(args), "kfac_seconds": t_kfac, "bare_seconds": t_bare, "tokens": n_tok,
                      "throughput_ratio": b / k, "environment": environment()}))


if __name__ == "__main__":
    main()
