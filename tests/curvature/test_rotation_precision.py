"""The projection's GEMMs in TF32 (``EditConfig.projection_precision="tf32"``): what leaks into
the masked (high-curvature) subspace stays below 1e-3 of the projected step's norm.

On a CPU the TF32 arithmetic is emulated — every matrix product's operands rounded to TF32's 10-bit mantissa
(round to nearest), the sums in float32, which is what a tensor core does — through a ``TorchFunctionMode``
around the projector's own code; on a CUDA device (marked ``gpu``; it runs whenever one is there)
the real tensor-core path is measured at SmolLM2's and Llama-3-8B's ``down_proj`` shapes. Gradients are built
the way a batch makes them (``Σ_t g_t a_tᵀ`` with ``a``, ``g`` drawn from the factors), so most of their norm lies
in the masked subspace, as in training — the hard case for rounding."""

from __future__ import annotations

import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

from crispedit.curvature import precision, projection
from crispedit.curvature.precision import rotation_precision
from crispedit.curvature.projection import KroneckerProjector
from crispedit.editing.config import PROJECTION_PRECISIONS, EditConfig
from crispedit.errors import CrispEditError

LEAK_BOUND = 1e-3


def tf32_round(t: torch.Tensor) -> torch.Tensor:
    """``t`` (float32) rounded to nearest at a 10-bit mantissa (TF32's), kept as float32."""
    bits = t.contiguous().view(torch.int32)
    rounded = (bits + 0x1000) & ~0x1FFF
    return rounded.view(torch.float32).reshape(t.shape)


class EmulatedTF32(TorchFunctionMode):
    """Matrix products with their float32 operands rounded to TF32 first (sums stay float32)."""

    OPS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.mm}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.OPS:
            args = tuple(tf32_round(a) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a for a in args)
        return func(*args, **kwargs)


def random_factors(d_out: int, d_in: int, gen: torch.Generator, device="cpu"):
    """Eigenbases (random orthogonal, float64) and power-law spectra like collected K-FAC factors'."""

    def basis(d):
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64, device=device))
        return q

    lam = lambda d: (torch.arange(1, d + 1, dtype=torch.float64) ** -1.5).to(device)  # noqa: E731
    return lam(d_out), basis(d_out), lam(d_in), basis(d_in)


def batch_gradient(lam_out, U_out, lam_in, U_in, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """``Σ_t g_t a_tᵀ`` over ``tokens`` pairs with ``a ~ N(0, A)``, ``g ~ N(0, S)`` (float64)."""

    def draw(lam, U):
        z = torch.randn(len(lam), tokens, generator=gen, dtype=torch.float64, device=U.device)
        return U @ (lam.sqrt()[:, None] * z)

    a, g = draw(lam_in, U_in), draw(lam_out, U_out)
    return g @ a.T


def leak(proj64: KroneckerProjector, step: torch.Tensor) -> float:
    """``‖(I - P) s‖ / ‖s‖`` in float64: the part of ``s`` in the masked subspace, relative to ``s``."""
    s = step.double()
    return float((s - proj64.project(s)).norm() / s.norm())


def _case(d_out, d_in, gamma, gen, device="cpu", tokens=256):
    lam_out, U_out, lam_in, U_in = random_factors(d_out, d_in, gen, device)
    proj = KroneckerProjector.from_spectra(lam_out, U_out, lam_in, U_in, gamma)  # float32, as training runs it
    exact = KroneckerProjector.from_spectra(lam_out, U_out, lam_in, U_in, gamma, dtype=torch.float64)
    G = batch_gradient(lam_out, U_out, lam_in, U_in, tokens, gen).float()
    return proj, exact, G


@pytest.mark.parametrize("gamma", [0.7, 0.8, 0.9])
def test_emulated_tf32_full_form_leaks_below_the_bound(gamma):
    gen = torch.Generator().manual_seed(0)
    proj, exact, G = _case(576, 1536, gamma, gen)
    fp32 = proj.project(G)
    with EmulatedTF32():
        tf32 = proj.unrotate(proj.rotate(G))  # what project() runs under TF32 when the full form pays
    assert not torch.equal(fp32, tf32)  # the emulation did round
    # the masked part of the gradient (≈ γ of its squared norm) is what rounding could leak back
    assert float(exact.project(G.double()).norm() / G.norm()) < 0.8
    assert leak(exact, fp32) < 1e-5
    assert leak(exact, tf32) < LEAK_BOUND / 5
    assert float((tf32 - fp32).norm() / fp32.norm()) < 5 * LEAK_BOUND  # TF32's relative error of the step


def test_the_low_rank_form_in_tf32_would_leak():
    """Why :meth:`project` never runs the low-rank form in TF32: it subtracts the masked part, whose rounding stays
    in the step (at γ 0.9 about the bound itself), while the full form masks after rounding."""
    gen = torch.Generator().manual_seed(0)
    proj, exact, G = _case(576, 1536, 0.9, gen)
    with EmulatedTF32():
        low_rank = proj._low_rank(G)
        full = proj.unrotate(proj.rotate(G))
    assert leak(exact, full) < LEAK_BOUND / 5 < leak(exact, low_rank)


def test_tf32_picks_the_full_form_only_where_it_pays(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    lam_out, U_out, lam_in, U_in = random_factors(96, 160, gen)
    steep = KroneckerProjector.from_spectra(lam_out, U_out, lam_in, U_in, 0.8)  # a small masked corner
    flat = KroneckerProjector.from_spectra(lam_out**0.1, U_out, lam_in**0.1, U_in, 0.8)  # a large one
    assert steep.low_rank and flat.flops_full <= projection.TF32_FULL_FORM_RATIO * flat.flops_low_rank
    assert steep.flops_full > projection.TF32_FULL_FORM_RATIO * steep.flops_low_rank
    assert flat.tf32_full_form() and not steep.tf32_full_form()
    G = batch_gradient(lam_out, U_out, lam_in, U_in, 64, gen).float()
    calls = []
    monkeypatch.setattr(projection, "tf32_gemms", lambda X: True)  # what a CUDA tensor under TF32 reports
    monkeypatch.setattr(KroneckerProjector, "_low_rank", lambda self, Q: calls.append("low_rank") or Q)
    monkeypatch.setattr(KroneckerProjector, "rotate", lambda self, Q: calls.append("full") or Q)
    monkeypatch.setattr(KroneckerProjector, "unrotate", lambda self, C: C)
    steep.project(G)
    flat.project(G)
    assert calls == ["low_rank", "full"]


def test_emulation_is_tf32_rounding():
    x = torch.tensor([1.0, 1.0 + 2**-10, 1.0 + 2**-11, 1.0 + 2**-12, -3.0 - 2**-12])
    assert tf32_round(x).tolist() == [1.0, 1.0 + 2**-10, 1.0 + 2**-10, 1.0, -3.0]


def test_cpu_ignores_tf32_and_restores_nothing():
    gen = torch.Generator().manual_seed(1)
    proj, _, G = _case(64, 96, 0.8, gen)
    before = torch.backends.cuda.matmul.fp32_precision
    with rotation_precision("tf32", "cpu"):
        out = proj.project(G)
    assert torch.equal(out, proj.project(G))
    assert torch.backends.cuda.matmul.fp32_precision == before


def test_cuda_flags_switch_only_when_needed_and_are_restored():
    """The CUDA flags (settable without a GPU): ``fp32`` in the default state sets nothing (no mixing with a
    legacy ``allow_tf32`` setting); under a process-wide TF32 it forces full float32 inside and restores after;
    ``tf32`` switches on inside and restores after."""
    matmul = torch.backends.cuda.matmul
    global_before, flag_before = torch.get_float32_matmul_precision(), matmul.fp32_precision
    try:
        torch.set_float32_matmul_precision("highest")
        matmul.fp32_precision = "none"
        with rotation_precision("fp32", "cuda"):
            assert matmul.fp32_precision == "none" and not precision._cuda_tf32()
        with rotation_precision("tf32", "cuda"):
            assert precision._cuda_tf32()
        assert matmul.fp32_precision == "none"
        torch.set_float32_matmul_precision("high")
        assert precision._cuda_tf32()
        with rotation_precision("fp32", "cuda"):
            assert not precision._cuda_tf32()
        assert precision._cuda_tf32()
    finally:
        torch.set_float32_matmul_precision(global_before)
        matmul.fp32_precision = flag_before


def test_bad_modes_are_refused():
    with pytest.raises(ValueError, match="rotation precision"):
        with rotation_precision("bf16", "cpu"):
            pass
    with pytest.raises(CrispEditError, match="projection precision"):
        EditConfig(projection_precision="bf16")
    assert PROJECTION_PRECISIONS == ("fp32", "tf32")


def test_config_stores_the_projection_precision():
    assert EditConfig().to_json()["projection_precision"] == "fp32"
    d = EditConfig(projection_precision="tf32").to_json()
    assert d["projection_precision"] == "tf32"
    assert EditConfig.from_dict(d).projection_precision == "tf32"
    assert EditConfig.from_dict(EditConfig().to_json()).projection_precision == "fp32"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the real tensor-core path)")
@pytest.mark.parametrize("shape", [(576, 1536), (4096, 14336)])
def test_cuda_tf32_projection_leaks_below_the_bound(shape):
    gen = torch.Generator("cuda").manual_seed(0)
    proj, exact, G = _case(*shape, 0.8, gen, device="cuda", tokens=512)
    fp32 = proj.project(G)
    outside = torch.backends.cuda.matmul.fp32_precision
    with rotation_precision("tf32", "cuda"):
        inside = torch.backends.cuda.matmul.fp32_precision
        tf32 = proj.project(G)
    assert inside == "tf32" and torch.backends.cuda.matmul.fp32_precision == outside
    assert proj.tf32_full_form() == (not torch.equal(fp32, tf32))  # tensor cores rounded where they ran
    lk = leak(exact, tf32)

    def ms(mode):  # a diagnostic for the GPU run's log (no assertion on time)
        with rotation_precision(mode, "cuda"):
            proj.project(G)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(5):
                proj.project(G)
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / 5 * 1e3

    print(
        f"{shape} γ 0.8 (fp32: {'low-rank' if proj.low_rank else 'full'} form; tf32: "
        f"{'full form' if proj.tf32_full_form() else 'low-rank form in fp32'}): leak fp32 {leak(exact, fp32):.2e}, "
        f"tf32 {lk:.2e}; step difference {float((tf32 - fp32).norm() / fp32.norm()):.2e}; "
        f"one projection fp32 {ms('fp32'):.2f} ms, tf32 {ms('tf32'):.2f} ms"
    )
    assert lk < LEAK_BOUND


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the real tensor-core path)")
def test_cuda_fp32_mode_forces_full_float32_under_a_global_tf32():
    """A process that turned TF32 on for everything (``set_float32_matmul_precision("high")``) still gets the
    projection in full float32 under ``rotation_precision("fp32")``: what ``"highest"`` gives, not TF32's."""
    gen = torch.Generator("cuda").manual_seed(0)
    proj, _, G = _case(576, 1536, 0.8, gen, device="cuda", tokens=512)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        ref = proj.project(G)
        torch.set_float32_matmul_precision("high")
        with rotation_precision("fp32", "cuda"):
            forced = proj.project(G)
        loose = proj.project(G)
    finally:
        torch.set_float32_matmul_precision(before)

    def rel(x):
        return float((x - ref).norm() / ref.norm())

    print(f"global TF32: forced fp32 differs from 'highest' by {rel(forced):.1e}, unforced by {rel(loose):.1e}")
    assert rel(forced) < 1e-6 < 1e-5 < rel(loose)
