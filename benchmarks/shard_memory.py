"""What one process holds during an edit with the model's decoder blocks split across N processes (``--shard``):
a calculator on a meta-device model (shapes only, no weights) and a measurement on a small random-weight llama.

    python benchmarks/shard_memory.py predict --shape llama3-8b --dtype bfloat16 --nproc 1,2,4,8
    python benchmarks/shard_memory.py predict --model-dir PATH --layers 'model.layers.{4-8}.mlp.down_proj' --nproc 4
    python benchmarks/shard_memory.py table --json results/shard_memory/table.json     # Llama-3-8B and -70B
    torchrun --nproc-per-node 2 benchmarks/shard_memory.py measure --shard --json F    # the small model, split
    python benchmarks/shard_memory.py measure --json F                                 # the same, one process
    torchrun --nproc-per-node 8 benchmarks/shard_memory.py measure --shard --shape llama3-8b --device cuda \
        --dtype bfloat16 --layers 'model.layers.{19-23}.mlp.down_proj'              # a GPU node (gpu_shard.sh)

The calculator counts, per process and in bytes (:func:`predict`): ``blocks`` — the frozen decoder-block weights,
a dim-0 slice of each (``ceil(rows / N)`` rows: FSDP2 pads); ``whole`` — what every process holds whole (the
embeddings, final norm, LM head and the edited weights); ``gathered`` — the unsplit weights of the two largest
blocks (the one running and the next, which FSDP2 may gather ahead), with N > 1; ``edit_state`` — the edited
weights' gradient, Adam's two moments and the starting copy kept for the delta (4 x their bytes, their dtype);
``projectors`` — each edited layer's float32 eigenbases and mask (``d_in² + d_out² + d_out·d_in``); ``factors`` —
the float32 K-FAC factors kept for the edit (``d_in² + d_out²``); ``kfac_sums`` — the float64 running sums while
the factors are collected. ``total`` = blocks + whole + gathered + factors + the larger of the collection
(``kfac_sums``) and the training (``edit_state + projectors``). Not counted: activations (they grow with the batch
and the sequence length), the eigendecomposition's temporaries and the framework's own buffers.

``measure`` runs a real edit of a random-weight llama (the small one by default; K-FAC collected, a few epochs;
split with ``--shard``) and records, per process, the weights it holds (exact, from the live parameters), the peak
during the edit (on CUDA the allocator's peak of tensor memory; on the CPU the process's peak resident memory from
the edit's start, with the interpreter and libraries, whose share is recorded before the model is built) and the
calculator's figures for the same model, layers and N. Every process builds the whole random model
on the host first (host memory: the model's bytes per process).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from crispedit.layers import decoder_blocks, default_layer_pattern, resolve_layers  # noqa: E402

# Architectures (config.json of the real checkpoints) and the small model measured here
SHAPES = {
    "small": dict(hidden=512, inter=1536, heads=8, kv_heads=4, vocab=512, blocks=8),
    "llama3-8b": dict(hidden=4096, inter=14336, heads=32, kv_heads=8, vocab=128256, blocks=32),
    "llama3-70b": dict(hidden=8192, inter=28672, heads=64, kv_heads=8, vocab=128256, blocks=80),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GIB = 2**30


def llama_config(shape: str):
    """The ``LlamaConfig`` of ``shape`` (:data:`SHAPES`)."""
    from transformers import LlamaConfig

    s = SHAPES[shape]
    return LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=s["blocks"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def meta_model(config, dtype: torch.dtype):
    """A causal LM of ``config`` on the meta device: every parameter's shape and dtype, no storage."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _sliced(p: torch.Tensor, nproc: int) -> int:
    """Bytes of one process's dim-0 slice of ``p`` split over ``nproc`` processes (rows padded up)."""
    rows = p.shape[0] if p.dim() else 1
    return math.ceil(rows / nproc) * (p.numel() // max(rows, 1)) * p.element_size()


def predict(model, layers: str, nproc: int) -> dict:
    """Bytes one process holds for an edit of ``model``'s ``layers`` (a module pattern) with the decoder blocks
    split over ``nproc`` processes (1: not split); the categories of the module docstring, and ``total``."""
    edited = resolve_layers(model, layers)
    kept = {id(m.weight) for m in edited.values()}
    _, blocks = decoder_blocks(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    out = dict.fromkeys(["blocks", "whole", "gathered", "edit_state", "projectors", "factors", "kfac_sums"], 0)
    for p in model.parameters():
        if id(p) in in_blocks and id(p) not in kept:
            out["blocks"] += _sliced(p, nproc)
        else:
            out["whole"] += p.numel() * p.element_size()
    if nproc > 1:
        sizes = sorted(
            (sum(p.numel() * p.element_size() for p in b.parameters() if id(p) not in kept) for b in blocks),
            reverse=True,
        )
        out["gathered"] = sum(sizes[:2])
    for m in edited.values():
        d_out, d_in = m.weight.shape
        out["edit_state"] += 4 * m.weight.numel() * m.weight.element_size()
        out["projectors"] += 4 * (d_in * d_in + d_out * d_out + d_out * d_in)
        out["factors"] += 4 * (d_in * d_in + d_out * d_out)
        out["kfac_sums"] += 8 * (d_in * d_in + d_out * d_out)
    out["total"] = (
        out["blocks"]
        + out["whole"]
        + out["gathered"]
        + out["factors"]
        + max(out["kfac_sums"], out["edit_state"] + out["projectors"])
    )
    return out


def held_weight_bytes(model) -> int:
    """Bytes of the weights this process stores: a split parameter's local slice, any other parameter whole."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).untyped_storage().nbytes() for p in model.parameters())


def _status_kib(field: str) -> int | None:
    """A ``VmRSS`` / ``VmHWM`` line of ``/proc/self/status`` in bytes (``None`` where there is no such file)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset this process's peak resident memory (``VmHWM``) to its current one (Linux: ``clear_refs`` 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def random_model(shape: str, blocks: int | None, dtype: torch.dtype):
    """A random-weight llama of ``shape`` (:data:`SHAPES`; ``blocks`` decoder blocks, default all) in ``dtype`` on
    the host, and a byte-level BPE tokenizer of 512 tokens (ids below every shape's vocabulary)."""
    from transformers import LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tokenizer

    config = llama_config(shape)
    config.num_hidden_layers = blocks or config.num_hidden_layers
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).eval(), build_tokenizer(512)


def measure(
    shard: bool,
    layers: str,
    n_cap: int,
    epochs: int,
    shape: str = "small",
    blocks: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> dict:
    """Edit a random-weight llama of ``shape`` (5 made-up facts, K-FAC on ``n_cap`` texts, ``epochs`` epochs) in this
    process — split across the torchrun group with ``shard`` — and return this process's figures: the weights it
    stores (``held_weights``), the peak during the edit (``peak_bytes``; CUDA: the allocator's peak of tensor
    memory; CPU: the process's peak resident memory, interpreter and libraries included, counted from the edit's
    start), the resident memory before the model was built (``rss_base``) and before the edit (``rss_before_edit``),
    and the calculator's figures for the same model, layers and N."""
    from crispedit.data.edits import EditRequest
    from crispedit.distributed import world_size
    from crispedit.editing import EditConfig, edit, shard_for_edit
    from crispedit.models import load_model
    from crispedit.weights import weight_fingerprint

    base_rss = _status_kib("VmRSS")  # the interpreter and libraries, before any model
    model, tok = load_model(random_model(shape, blocks, dtype))
    config = EditConfig(layers=layers, n_cap=n_cap, max_len=64, epochs=epochs, batch_size=8, contexts="bare")
    if shard:
        fp = shard_for_edit(model, config, device)
    else:
        fp = weight_fingerprint(model)
        model.to(device)
    requests = [EditRequest(f"Who founded club {i}?", f"Founder {chr(65 + i)}") for i in range(5)]
    cuda = torch.device(device).type == "cuda"
    cache = os.environ.get("TMPDIR", "/tmp") + f"/shard_memory_cache_{os.getpid()}"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = _status_kib("VmRSS")
    reset = _reset_peak_rss()  # the peak of the edit, not of building the whole model before the split
    edit(model, tok, requests, config, progress=False, fingerprint=fp, cache_root=cache)
    peak = torch.cuda.max_memory_allocated() if cuda else (_status_kib("VmHWM") if reset else None)
    meta_config = llama_config(shape)
    meta_config.num_hidden_layers = blocks or meta_config.num_hidden_layers
    n = world_size() if shard else 1
    return {
        "held_weights": held_weight_bytes(model),
        "peak_bytes": peak,
        "rss_before_edit": before,
        "rss_base": base_rss,
        "predicted": predict(meta_model(meta_config, dtype), layers, n),
        "nproc_split": n,
    }


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cmd_measure(args) -> dict:
    """``measure``: every process measures; the figures are gathered to rank 0, which writes ``--json``."""
    import torch.distributed as dist

    from crispedit.distributed import process_group_from_env, rank

    if args.device == "cpu":
        torch.set_num_threads(1)
    with process_group_from_env(args.device) as device:
        mine = measure(
            args.shard,
            args.layers,
            args.n_cap,
            args.epochs,
            args.shape,
            args.blocks,
            DTYPES[args.dtype],
            device or "cpu",
        )
        rows = [mine]
        if dist.is_initialized():
            rows = [None] * dist.get_world_size()
            dist.all_gather_object(rows, mine)
        first = rank() == 0
    return (
        {
            "processes": rows,
            "shard": args.shard,
            "layers": args.layers,
            "n_cap": args.n_cap,
            "epochs": args.epochs,
            "shape": args.shape,
            "blocks": args.blocks,
            "dtype": args.dtype,
            "device": args.device,
        }
        if first
        else {}
    )


def table(dtype: torch.dtype, nprocs: list[int]) -> dict:
    """The calculator's figures for Llama-3-8B and -70B with crispedit's default layers for them, in ``dtype``, for
    each N of ``nprocs``."""
    out = {}
    for shape in ("llama3-8b", "llama3-70b"):
        model = meta_model(llama_config(shape), dtype)
        layers = default_layer_pattern(model)
        out[shape] = {"layers": layers, "per_process": {str(n): predict(model, layers, n) for n in nprocs}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("predict", help="what one process holds, for a model shape")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--model-dir", default=None, help="an HF model directory (its config.json only) instead of --shape")
    p.add_argument("--layers", default=None, help="edited layers (default: crispedit's default for the model)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--nproc", default="1,2,4,8", help="comma-separated numbers of processes")
    t = sub.add_parser("table", help="the docs table: Llama-3-8B and -70B")
    t.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    t.add_argument("--nproc", default="1,2,4,8")
    m = sub.add_parser("measure", help="measure an edit of the small random model (under torchrun with --shard)")
    m.add_argument("--shard", action="store_true")
    m.add_argument("--shape", choices=sorted(SHAPES), default="small")
    m.add_argument("--blocks", type=int, default=None, help="decoder blocks (default: the shape's)")
    m.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    m.add_argument(
        "--device",
        default="cpu",
        help="cpu (gloo; the peak resident memory) or cuda (NCCL; the allocator's peak, one GPU a process)",
    )
    m.add_argument("--layers", default="model.layers.{3-4}.mlp.down_proj")
    m.add_argument("--n-cap", type=int, default=16)
    m.add_argument("--epochs", type=int, default=2)
    for q in (p, t, m):
        q.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    nprocs = [int(x) for x in getattr(args, "nproc", "1").split(",")]
    if args.cmd == "predict":
        if args.model_dir:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(args.model_dir)
        else:
            config = llama_config(args.shape)
        model = meta_model(config, DTYPES[args.dtype])
        layers = args.layers or default_layer_pattern(model)
        res = {
            "model": args.model_dir or args.shape,
            "layers": layers,
            "dtype": args.dtype,
            "per_process": {str(n): predict(model, layers, n) for n in nprocs},
        }
        for n, row in res["per_process"].items():
            print(f"N={n:>3}: " + "  ".join(f"{k} {v / GIB:.2f}" for k, v in row.items()) + "  (GiB)")
    elif args.cmd == "table":
        res = {"dtype": args.dtype, **table(DTYPES[args.dtype], nprocs)}
        for shape in ("llama3-8b", "llama3-70b"):
            print(
                shape, " ".join(f"N={n}: {row['total'] / GIB:.1f} GiB" for n, row in res[shape]["per_process"].items())
            )
    else:
        res = cmd_measure(args)
        for i, row in enumerate(res.get("processes", [])):
            print(
                f"rank {i}: held weights {row['held_weights']} B "
                f"(predicted {row['predicted']['blocks'] + row['predicted']['whole']}), "
                f"peak {row['peak_bytes']} B (base {row['rss_base']} B + predicted without activations "
                f"{row['predicted']['total']} B)"
            )
    if res and args.json:
        res["command"] = "python " + " ".join([os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])])
        res["commit"] = _git_commit()
        res["torch"] = torch.__version__
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
