"""What float64 eigendecompositions of K-FAC factors cost against float32: ``torch.linalg.eigh`` of random
symmetric positive definite matrices in both precisions, interleaved in one process.

    python benchmarks/bench_eigh.py [--sizes 1536,4096] [--repeats 3] [--device cpu] [--json FILE]
    python benchmarks/bench_eigh.py --factors <cache>/kfac/<key>.safetensors [--gammas 0.8,0.9,0.99,0.999] --json FILE

crispedit decomposes every factor in float64 on every device (``crispedit.curvature.eigen``): a float32 solver's
eigenvectors mix the masked and kept directions of a wide spectrum. This measures what that costs. Each size gets one
matrix ``U diag(λ) Uᵀ`` (``U`` a random orthogonal matrix, ``λ`` log-spaced over eight decades, the shape of a real
factor's spectrum), decomposed ``--repeats`` times in each dtype (float32 and float64 alternating, so machine noise
hits both alike; one untimed warm-up each first). Prints and returns the fastest run per dtype (other processes'
work only ever adds time, so the fastest is the least disturbed; the medians are stored too), the float64 / float32
ratio of the fastest runs per size, and the float64 and float32 times at ``--extrapolate`` (default 14 336, Llama-3-8B's
``down_proj`` input width) extrapolated as ``n³`` from the largest measured size: an extrapolation, not a
measurement.

``--factors FILE`` measures what the precision does instead: on each layer of a K-FAC factor file (crispedit's cache
format), the relative error of one random gradient's projection at each ``--gammas`` value against the paper's
formula in float64 (torch's float64 eigendecompositions, float64 arithmetic) for the projector crispedit builds
(``factor_eigh``: float64 decompositions, float32 bases and projection) and for the same built from a float32
eigensolver (``torch.linalg.eigh`` in float32: what a GPU ran before every device decomposed in float64).

``--json FILE`` writes the figures with the command line, the commit, the thread and CPU counts and
the machine's load averages before and after (the interleaving spreads other processes' work over both dtypes).
"""

from __future__ import annotations

import argparse
import os
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
    p.add_argument(
        "--factors",
        default=None,
        metavar="FILE",
        help="a K-FAC factor file: measure projection errors instead of timing (module docstring)",
    )
    p.add_argument("--gammas", default="0.8,0.9,0.99,0.999", help="γ values of --factors (default 0.8,0.9,0.99,0.999)")
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


# What the figures depend on besides torch: ``-dirty`` on the commit when one of these differs from it.
_MEASURED = ("benchmarks/bench_eigh.py", "src/crispedit/curvature/eigen.py", "src/crispedit/curvature/projection.py")


def _commit() -> str | None:
    """The repository's HEAD commit (with ``-dirty`` when a file of :data:`_MEASURED` differs from it), or None
    outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *_MEASURED], cwd=ROOT).returncode != 0
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


def paper_projection(A, S, gamma: float, Q):
    """The paper's projection of ``Q`` (``d_out x d_in``) for the K-FAC factors ``A`` (``d_in x d_in``) and ``S``
    (``d_out x d_out``), all in float64: ``U_out((U_outᵀ Q U_in) ⊙ M)U_inᵀ`` with torch's float64 eigendecompositions
    and ``M`` the γ-energy mask of the sorted Kronecker spectrum (``energy_keep_mask``)."""
    import torch

    from crispedit.curvature.masks import energy_keep_mask

    lam_in, U_in = torch.linalg.eigh(A.double())
    lam_out, U_out = torch.linalg.eigh(S.double())
    lam_in, U_in = lam_in.flip(0).clamp_min(0), U_in.flip(1)
    lam_out, U_out = lam_out.flip(0).clamp_min(0), U_out.flip(1)
    M = energy_keep_mask(torch.outer(lam_out, lam_in), gamma).double()
    return U_out @ ((U_out.T @ Q.double() @ U_in) * M) @ U_in.T


def projection_errors(path: str, gammas: list[float], seed: int = 0) -> dict:
    """Per layer of the factor file ``path`` and per γ: the relative Frobenius error of one random gradient's
    projection against :func:`paper_projection`, for crispedit's projector (``crispedit``) and for the one a float32
    eigensolver gives (``float32_eigh``); with the layer's factor sizes."""
    import torch

    from crispedit.curvature.eigen import factor_eigh
    from crispedit.curvature.factors import KFACFactors
    from crispedit.curvature.projection import KroneckerProjector
    from crispedit.safetensors_io import load_safetensors

    # Only the matrices matter here, so a factor file of any crispedit version is read (no version check, unlike
    # cache.load_factors), and without a source the decompositions neither read nor write an eigenbasis cache.
    meta, tensors = load_safetensors(path, "curvature cache", "crispedit")
    factors = KFACFactors.from_tensors(tensors, int(meta.get("n_tokens", 0)), meta)
    factors.source = {}
    out = {}
    for name in factors.A:
        A, S = factors.A[name], factors.S[name]
        eig = factor_eigh(factors, [name])
        la, Ua = torch.linalg.eigh(A.float())
        ls, Us = torch.linalg.eigh(S.float())
        f32 = (ls.flip(0).double().clamp_min(0), Us.flip(1), la.flip(0).double().clamp_min(0), Ua.flip(1))
        Q = torch.randn(S.shape[0], A.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        row = {"d_out": S.shape[0], "d_in": A.shape[0]}
        for g in gammas:
            ref = paper_projection(A, S, g, Q)
            err = lambda P, Q=Q, ref=ref: float((P.project(Q.float()).double() - ref).norm() / ref.norm())  # noqa: E731
            ours = KroneckerProjector.from_spectra(*eig[name, "S"], *eig[name, "A"], g)
            row[str(g)] = {
                "crispedit": float(f"{err(ours):.3g}"),
                "float32_eigh": float(f"{err(KroneckerProjector.from_spectra(*f32, g)):.3g}"),
            }
        out[name] = row
        print(
            f"  {name} ({row['d_out']} x {row['d_in']}): "
            + "  ".join(f"γ {g}: {row[str(g)]['crispedit']:.1e} / {row[str(g)]['float32_eigh']:.1e}" for g in gammas)
        )
    return out


def main(argv=None) -> dict:
    """Time float32 and float64 ``torch.linalg.eigh`` at each size; print and return the figures (module
    docstring)."""
    import torch

    from crispedit.atomic import atomic_write_json

    args = _args(argv)
    command = "python benchmarks/bench_eigh.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.factors:
        gammas = [float(g) for g in args.gammas.split(",") if g.strip()]
        print(f"projection error against the float64 formula (crispedit / float32 eigh), {args.factors}")
        from crispedit.safetensors_io import read_safetensors_header

        spec = read_safetensors_header(args.factors, "curvature cache", "crispedit")[0].get("spec", {})
        out = {
            "command": command,
            "commit": _commit(),
            "torch": torch.__version__,
            "factors": Path(args.factors).name,
            "factors_spec": spec,
            "gammas": gammas,
            "layers": projection_errors(args.factors, gammas, args.seed),
        }
        if args.json:
            atomic_write_json(args.json, out)
        return out
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    out = {
        "command": command,
        "commit": _commit(),
        "torch": torch.__version__,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "repeats": args.repeats,
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "sizes": {},
    }
    print(f"torch.linalg.eigh on {args.device}, {out['threads']} threads, {args.repeats} repeats per dtype")
    for n in sizes:
        M64 = spd_matrix(n, args.seed).to(args.device)
        mats = {"float32": M64.float(), "float64": M64}
        times: dict[str, list[float]] = {k: [] for k in mats}
        for M in mats.values():
            _time_eigh(M, args.device)  # warm-up (workspace, threads)
        for _ in range(args.repeats):
            for k, M in mats.items():
                times[k].append(_time_eigh(M, args.device))
        row = {
            k: {
                "seconds": [round(t, 4) for t in ts],
                "min_s": round(min(ts), 4),
                "median_s": round(statistics.median(ts), 4),
            }
            for k, ts in times.items()
        }
        row["ratio_float64_over_float32"] = round(row["float64"]["min_s"] / row["float32"]["min_s"], 2)
        row["ratio_of_medians"] = round(row["float64"]["median_s"] / row["float32"]["median_s"], 2)
        out["sizes"][str(n)] = row
        print(
            f"  n={n:6d}  float32 {row['float32']['min_s']:9.3f} s  float64 {row['float64']['min_s']:9.3f} s"
            f"  float64/float32 {row['ratio_float64_over_float32']:.2f}x  (medians: {row['ratio_of_medians']:.2f}x)"
        )
        del M64, mats
    n_max = max(sizes)
    scale = (args.extrapolate / n_max) ** 3
    big = out["sizes"][str(n_max)]
    out["extrapolated"] = {
        "n": args.extrapolate,
        "from_n": n_max,
        "rule": "n^3",
        "float32_s": round(big["float32"]["min_s"] * scale, 1),
        "float64_s": round(big["float64"]["min_s"] * scale, 1),
    }
    out["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    ex = out["extrapolated"]
    print(
        f"  extrapolated (n^3 from n={n_max}) to n={ex['n']}: float32 {ex['float32_s']:.0f} s, "
        f"float64 {ex['float64_s']:.0f} s"
    )
    if args.json:
        atomic_write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
