"""What identifying a model's weights costs: :func:`crispedit.weights.weight_fingerprint` (XXH3-128, what every edit,
cache lookup, session and compare computes once) against blake2b-128, a cryptographic hash, of the same bytes
(:func:`blake2b_fingerprint`), the two interleaved in one process over the same weights.

    python benchmarks/bench_fingerprint.py --model smollm2 --repeats 3
    python benchmarks/bench_fingerprint.py --random-init llama3-8b --blocks 4 --dtype bfloat16
    python benchmarks/bench_fingerprint.py --random-init llama3-8b --dtype bfloat16 --device cuda   # a GPU machine

Prints the bytes hashed, each digest's median seconds and GB/s, and the blake2b / XXH3 time ratio; ``--json FILE``
writes them. A CUDA model's figures include the copies of its weights to the host.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model", default="smollm2", help="a model spec for crispedit.models.load_model (default smollm2)"
    )
    src.add_argument(
        "--random-init",
        choices=("smollm2", "llama3-8b"),
        default=None,
        help="random weights of a real architecture (no files needed)",
    )
    p.add_argument("--blocks", type=int, default=None, help="decoder blocks of a --random-init model (default: all)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each digest, interleaved (default 3)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON")
    return p.parse_args(argv)


def blake2b_fingerprint(model) -> str:
    """The 32-hex-digit blake2b-128 digest of what :func:`~crispedit.weights.weight_fingerprint` hashes (the model
    type and every parameter and buffer): the cryptographic hash XXH3 is timed against."""
    import hashlib

    from crispedit.weights import _hash_weights

    return _hash_weights(model, hashlib.blake2b(digest_size=16))


def main(argv=None) -> dict:
    """Time both fingerprints of one model ``--repeats`` times, interleaved; print and return the figures."""
    import torch

    from crispedit.atomic import atomic_write_json
    from crispedit.models import load_model
    from crispedit.weights import weight_fingerprint

    args = _args(argv)
    dtype = getattr(torch, args.dtype)
    if args.random_init:
        from bench_scale import random_model

        model, _ = random_model(args.random_init, args.blocks, dtype, args.device)
        what = f"random-init {args.random_init}" + (f", {args.blocks} blocks" if args.blocks else "")
    else:
        model, _ = load_model(args.model, dtype=args.dtype, device=args.device)
        what = args.model
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    times: dict[str, list[float]] = {"xxh3": [], "blake2b": []}
    digests = {}
    for _ in range(args.repeats):
        for name, fn in (("xxh3", weight_fingerprint), ("blake2b", blake2b_fingerprint)):
            t0 = time.perf_counter()
            digests[name] = fn(model)
            times[name].append(time.perf_counter() - t0)
    out = {
        "model": what,
        "dtype": args.dtype,
        "device": args.device,
        "bytes": nbytes,
        "repeats": args.repeats,
        "digests": digests,
    }
    print(f"{what} ({args.dtype}, {args.device}): {nbytes / 2**30:.2f} GiB of parameters and buffers")
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {
            "seconds": [round(t, 4) for t in ts],
            "median_s": round(med, 4),
            "gb_per_s": round(nbytes / med / 1e9, 2),
        }
        print(f"  {name:8s} median {med:8.3f} s  {nbytes / med / 1e9:7.2f} GB/s  ({', '.join(f'{t:.3f}' for t in ts)})")
    out["ratio_blake2b_over_xxh3"] = round(out["blake2b"]["median_s"] / out["xxh3"]["median_s"], 1)
    print(f"  blake2b / xxh3: {out['ratio_blake2b_over_xxh3']}x")
    if args.json:
        atomic_write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
