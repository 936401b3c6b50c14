"""What float64 eigendecompositions of K-FAC factors cost against float32: ``torch.linalg.eigh`` of random
symmetric positive definite matrices in both precisions, interleaved in one process.

    python benchmarks/bench_eigh.py [--sizes 1536,4096] [--repeats 3] [--device cpu] [--json FILE]

crispedit decomposes every factor in float64 on every device (``crispedit.curvature.eigen``): a float32 solver's
eigenvectors mix the masked and kept directions of a wide spectrum. This measures what that costs. Each size gets one
matrix ``U diag(λ) Uᵀ`` (``U`` a random orthogonal matrix, ``λ`` log-spaced over eight decades, the shape of a real
factor's spectrum), decomposed ``--repeats`` times in each dtype (float32 and float64 alternating, so machine noise
hits both alike; one untimed warm-up each first). Prints and returns the median seconds per dtype, the float64 /
float32 ratio per size, and the float64 and float32 times at ``--extrapolate`` (default 14 336, Llama-3-8B's
``down_proj`` input width) extrapolated as ``n³`` from the largest measured size: an extrapolation, not a
measurement. ``--json FILE`` writes the figures with the command line, the commit and the thread count.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1536,4096", help="comma-separated matrix sizes (default 1536,4096)")
    p.add_argument("--repeats", type=int, default=3, help="timed decompositions per size and dtype (default 3)")
    p.add_argument("--device", default="cpu", help="where torch.linalg.eigh runs (default cpu)")
    p.add_argument("--extrapolate", type=int, default=14336, help="size to extrapolate to as n^3 (default 14336)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON")
    return p.parse_args(argv)


def spd_matrix(n: int, seed: int = 0, decades: float = 8.0):
    """A random ``n x n`` symmetric positive definite float64 matrix ``U diag(λ) Uᵀ``: ``U`` the Q factor of a
    Gaussian matrix, ``λ`` log-spaced from 1 down to ``10**-decades``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    lam = torch.logspace(0.0, -decades, n, dtype=torch.float64)
    M = (U * lam) @ U.T
    return 0.5 * (M + M.T)


def _commit() -> str | None:
    """The repository's HEAD commit (with ``-dirty`` when tracked files differ from it), or None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def _time_eigh(M, device) -> float:
    """Seconds of one ``torch.linalg.eigh(M)`` on ``device`` (synchronised on a CUDA device)."""
    import torch

    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    torch.linalg.eigh(M)
    sync()
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    """Time float32 and float64 ``torch.linalg.eigh`` at each size; print and return the figures (module
    docstring)."""
    import torch

    from crispedit.errors import atomic_write_json

    args = _args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    out = {"command": "python benchmarks/bench_eigh.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "commit": _commit(), "torch": torch.__version__, "device": args.device,
           "threads": torch.get_num_threads(), "repeats": args.repeats, "sizes": {}}
    print(f"torch.linalg.eigh on {args.device}, {out['threads']} threads, {args.repeats} repeats per dtype")
    for n in sizes:
        M64 = spd_matrix(n, args.seed).to(args.device)
        mats = {"float32": M64.float(), "float64": M64}
        times: dict[str, list[float]] = {k: [] for k in mats}
        for k, M in mats.items():
            _time_eigh(M, args.device)  # warm-up (workspace, threads)
        for _ in range(args.repeats):
            for k, M in mats.items():
                times[k].append(_time_eigh(M, args.device))
        row = {k: {"seconds": [round(t, 4) for t in ts], "median_s": round(statistics.median(ts), 4)}
               for k, ts in times.items()}
        row["ratio_float64_over_float32"] = round(row["float64"]["median_s"] / row["float32"]["median_s"], 2)
        out["sizes"][str(n)] = row
        print(f"  n={n:6d}  float32 {row['float32']['median_s']:9.3f} s  float64 {row['float64']['median_s']:9.3f} s"
              f"  float64/float32 {row['ratio_float64_over_float32']:.2f}x")
        del M64, mats
    n_max = max(sizes)
    scale = (args.extrapolate / n_max) ** 3
    big = out["sizes"][str(n_max)]
    out["extrapolated"] = {"n": args.extrapolate, "from_n": n_max, "rule": "n^3",
                           "float32_s": round(big["float32"]["median_s"] * scale, 1),
                           "float64_s": round(big["float64"]["median_s"] * scale, 1)}
    ex = out["extrapolated"]
    print(f"  extrapolated (n^3 from n={n_max}) to n={ex['n']}: float32 {ex['float32_s']:.0f} s, "
          f"float64 {ex['float64_s']:.0f} s")
    if args.json:
        atomic_write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
