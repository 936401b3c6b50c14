"""Low-curvature projectors.

A projector maps a weight gradient ``Q`` (shape ``d_out x d_in``) onto the gamma-approximate nullspace
of a curvature model of the capability loss. Every projector answers one method, :meth:`project`,
and can build its explicit matrix with :meth:`dense` (tests only; it is ``(d_in d_out)^2``).

The vectorisation convention, the eigendecompositions and the energy rule that makes the keep masks are in
:mod:`.masks`; the rotations' arithmetic on a GPU (float32 or TF32) in :mod:`.precision`.

Low-rank form: the masked (removed, high-curvature) set of a :class:`KroneckerProjector` is the top of
the Kronecker spectrum, which lies in the leading ``r_out`` eigenvectors of ``S`` and ``r_in`` of ``A``
(eigenvalues are stored in decreasing order). Then ``P Q = Q - U_r ((U_r^T Q V_r) * (1 - M)_r) V_r^T``
with ``U_r = U_out[:, :r_out]``, ``V_r = U_in[:, :r_in]``, ``(1 - M)_r`` the ``r_out x r_in`` corner
of the complement of the keep mask: exact (not an approximation) whatever the shape of the masked set,
since every masked entry lies in that corner by construction of ``r_out`` / ``r_in``.

Two-block (staircase) form: the masked set of a real spectrum is a staircase that can reach far along
*both* axes (the top eigenvector of ``S`` pairs with almost every eigenvector of ``A`` and vice versa)
while covering little area, so its bounding corner is nearly the whole matrix. Splitting its rows at
``R`` gives two corners: rows ``[0, R)`` × columns ``[0, w_top)`` and rows ``[R, r_out)`` × columns
``[0, w_bot)`` (``w_*`` the widest masked row of each part); the removed component is the sum of the two
corners' low-rank terms, again exact. Each projector picks, from its mask, the split (``R = 0`` or
``r_out`` is the one-corner form) and GEMM order of fewest FLOPs, or the full rotation if that costs
fewer (:func:`staircase_projection_flops`).

All maths runs in float32 or float64 whatever the dtype of the gradient; results are cast back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .masks import eigh_psd, energy_keep_mask, kronecker_keep_mask, masked_corner, row_extents, unvec, vec
from .precision import TF32_FULL_FORM_RATIO, rotation_precision, tf32_gemms

__all__ = [
    "LayerProjector",
    "IdentityProjector",
    "KroneckerProjector",
    "DenseProjector",
    "AlternatingProjector",
    "kronecker_projection_flops",
    "staircase_projection_flops",
]


def kronecker_projection_flops(d_out: int, d_in: int, r_out: int | None, r_in: int) -> tuple[int, int]:
    """``(low_rank, full)`` floating-point operations (a multiply-add counts 2) of one projection of a
    ``d_out x d_in`` gradient by a Kronecker projector whose masked entries lie in the leading
    ``r_out x r_in`` corner of its eigenbasis.

    Full form ``U_out ((U_out^T Q U_in) * M) U_in^T``: four GEMMs, ``4 d_out d_in (d_out + d_in)``, plus the
    mask. Low-rank form ``Q - U_r ((U_r^T Q V_r) * (1 - M)_r) V_r^T``: four thin GEMMs in the cheaper of the
    two association orders, ``4 min(r_out d_in (d_out + r_in), r_in d_out (d_in + r_out))``, plus the corner
    mask and the subtraction; zero when nothing is masked. ``r_out=None``: no output-side rotation
    (Adam-NSCL's input-only projector): full ``4 d_out d_in^2``, low-rank ``4 d_out d_in r_in``."""
    if r_out is None:
        full = 4 * d_out * d_in * d_in + d_out * d_in
        low = 0 if r_in == 0 else 4 * d_out * d_in * r_in + d_out * r_in + d_out * d_in
        return low, full
    full = 4 * d_out * d_in * (d_out + d_in) + d_out * d_in
    if r_out == 0 or r_in == 0:
        return 0, full
    gemms = 4 * min(r_out * d_in * (d_out + r_in), r_in * d_out * (d_in + r_out))
    return gemms + r_out * r_in + d_out * d_in, full


def _block_flops(h, w, d_out: int, d_in: int):
    """FLOPs of the four thin GEMMs of one ``h x w`` corner block in the cheaper association order, and
    whether that order rotates the output side first (arrays or ints)."""
    import numpy as np

    out_first = 4 * h * d_in * (d_out + w)
    in_first = 4 * w * d_out * (d_in + h)
    return np.minimum(out_first, in_first) * ((h > 0) & (w > 0)), out_first <= in_first


def staircase_projection_flops(d_out: int, d_in: int, extents: Tensor) -> tuple[int, int, int]:
    """``(low_rank, full, split)``: FLOPs (a multiply-add counts 2) of one projection of a ``d_out x d_in``
    gradient in the best two-block form of the module docstring, of the full form, and the row split ``R``
    that reaches the first. ``extents`` are the mask's :func:`row_extents`.

    Rows ``[0, R)`` form one corner block of width ``w_top = max(extents[:R])``, rows ``[R, r_out)`` another of
    width ``w_bot = max(extents[R:])``; each costs ``4 min(h d_in (d_out + w), w d_out (d_in + h))`` in its
    cheaper GEMM order, plus one mask entry per corner element and the final subtraction ``d_out d_in``.
    ``R = r_out`` (one block) is :func:`kronecker_projection_flops`' corner. Zero when nothing is masked."""
    import numpy as np

    full = 4 * d_out * d_in * (d_out + d_in) + d_out * d_in
    e = extents.detach().cpu().numpy().astype(np.int64)
    nz = np.nonzero(e)[0]
    if len(nz) == 0:
        return 0, full, 0
    r_out = int(nz[-1]) + 1
    e = e[:r_out]
    R = np.arange(r_out + 1, dtype=np.int64)
    top = np.concatenate([[0], np.maximum.accumulate(e)])  # max(e[:R])
    bot = np.concatenate([np.maximum.accumulate(e[::-1])[::-1], [0]])  # max(e[R:])
    cost = (
        _block_flops(R, top, d_out, d_in)[0]
        + _block_flops(r_out - R, bot, d_out, d_in)[0]
        + R * top
        + (r_out - R) * bot
        + d_out * d_in
    )
    best = int(np.argmin(cost[::-1]))  # ties -> the largest R (the one-corner form first)
    split = r_out - best
    return int(cost[split]), full, split


class LayerProjector:
    """A linear operator on the weight-gradient space of one layer."""

    d_out: int
    d_in: int

    def project(self, Q: Tensor) -> Tensor:  # pragma: no cover - interface
        """``P vec(Q)`` for a weight-shaped ``Q`` (``d_out x d_in``), returned in ``Q``'s dtype."""
        raise NotImplementedError

    def rotate(self, Q: Tensor) -> Tensor:
        """Coordinates of the projected ``Q`` in the projector's eigenbasis (masked), float32 or
        better: ``project(Q) == unrotate(rotate(Q))``. Used by Adam in the eigenbasis."""
        raise NotImplementedError(f"{type(self).__name__} has no Kronecker eigenbasis")

    def unrotate(self, C: Tensor) -> Tensor:
        """Map eigenbasis coordinates ``C`` back to a weight-shaped matrix (inverse rotation; the
        result lies in the kept subspace when ``C`` is zero on masked entries)."""
        raise NotImplementedError(f"{type(self).__name__} has no Kronecker eigenbasis")

    def dense(self) -> Tensor:
        """The explicit ``(d_in d_out) x (d_in d_out)`` projector on ``vec(Q)`` (tests only)."""
        n = self.d_out * self.d_in
        eye = torch.eye(n, dtype=torch.float64)
        cols = [vec(self.project(unvec(eye[:, j], self.d_out, self.d_in))) for j in range(n)]
        return torch.stack(cols, dim=1)

    @property
    def kept_fraction(self) -> float:
        """Fraction of eigen-directions kept (1.0 for the identity)."""
        return 1.0

    def stats(self) -> dict:
        """What an edit report shows about this projector: ``kept_fraction`` (rounded to 6 digits)."""
        return {"kept_fraction": round(self.kept_fraction, 6)}

    def to(self, device: torch.device | str) -> LayerProjector:
        """The projector with its tensors on ``device`` (in place; returns ``self``)."""
        return self


class IdentityProjector(LayerProjector):
    """No projection: plain fine-tuning (the paper's "no projection" row)."""

    def __init__(self, d_out: int, d_in: int):
        self.d_out, self.d_in = d_out, d_in

    def project(self, Q: Tensor) -> Tensor:
        """The identity."""
        return Q

    def rotate(self, Q: Tensor) -> Tensor:
        """The identity (the standard basis is an eigenbasis of the identity), in float32 or better."""
        return Q if Q.dtype == torch.float64 else Q.float()

    def unrotate(self, C: Tensor) -> Tensor:
        """The identity."""
        return C


@dataclass
class KroneckerProjector(LayerProjector):
    """Matrix-free projector ``Q -> U_out ((U_out^T Q U_in) * M) U_in^T``.

    ``U_out`` (``d_out x d_out``) may be ``None`` (identity): that is the activation-covariance projector
    of Adam-NSCL, which constrains only the input side. ``U_in`` is ``d_in x d_in``. ``mask`` holds 1 for
    kept entries of the Kronecker eigenbasis (shape ``d_out x d_in``, or ``1 x d_in`` when ``U_out`` is
    ``None``).

    :meth:`project` computes the same operator in the low-rank form of the module docstring when that
    costs fewer FLOPs (``form="auto"``; ``"full"`` / ``"low_rank"`` force one). ``r_out`` / ``r_in``
    (the masked corner, :func:`masked_corner`; ``r_out`` is ``None`` without ``U_out``),
    ``flops_low_rank`` / ``flops_full`` (:func:`kronecker_projection_flops`, per projection) and
    ``low_rank`` (the form used) are set at construction. :meth:`rotate` / :meth:`unrotate` always use the
    full eigenbasis (the eigenbasis Adam keeps moments for every coordinate).
    """

    U_out: Tensor | None
    U_in: Tensor
    mask: Tensor
    dtype: torch.dtype = torch.float32
    form: str = "auto"

    def __post_init__(self) -> None:
        if self.form not in ("auto", "full", "low_rank"):
            raise ValueError(f"form must be 'auto', 'full' or 'low_rank', not {self.form!r}")
        self.U_in = self.U_in.to(self.dtype).contiguous()
        self.U_out = None if self.U_out is None else self.U_out.to(self.dtype).contiguous()
        self.mask = self.mask.to(device=self.U_in.device, dtype=self.dtype).contiguous()
        self.d_in = self.U_in.shape[0]
        self.d_out = self.mask.shape[0] if self.U_out is None else self.U_out.shape[0]
        if self.U_out is None and self.mask.shape[0] == 1:
            self.d_out = -1  # any number of rows
        r_out, self.r_in = masked_corner(self.mask)
        self.r_out = None if self.U_out is None else r_out
        # FLOPs per projection; without U_out and a broadcast mask, per gradient row (the ratio is what counts)
        if self.U_out is None:
            self.flops_low_rank, self.flops_full = kronecker_projection_flops(
                max(self.d_out, 1), self.d_in, None, self.r_in
            )
            self.split = 0
        else:
            self.flops_low_rank, self.flops_full, self.split = staircase_projection_flops(
                self.d_out, self.d_in, row_extents(self.mask)
            )
        self.low_rank = self.form == "low_rank" or (self.form == "auto" and self.flops_low_rank < self.flops_full)
        # the corner blocks of the low-rank form: (row slice, width, kept entries of the block (bool, zeroed in
        # the form, which removes the rest), U_out side rotated first?)
        self._blocks: list[tuple[slice, int, Tensor, bool]] = []
        if self.U_out is None:
            self._blocks.append((slice(None), self.r_in, (self.mask[:, : self.r_in] != 0).contiguous(), False))
        elif r_out:
            ext = row_extents(self.mask)
            for rows in (slice(0, self.split), slice(self.split, r_out)):
                h = rows.stop - rows.start
                w = int(ext[rows].max()) if h else 0
                if h and w:
                    out_first = bool(_block_flops(h, w, self.d_out, self.d_in)[1])
                    self._blocks.append((rows, w, (self.mask[rows, :w] != 0).contiguous(), out_first))

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def from_factors(
        cls,
        A: Tensor,
        S: Tensor,
        gamma: float,
        *,
        dtype: torch.dtype = torch.float32,
        eig_dtype: torch.dtype = torch.float64,
    ) -> KroneckerProjector:
        """K-FAC projector from the input covariance ``A`` and output-gradient covariance ``S``."""
        lam_in, U_in = eigh_psd(A, eig_dtype)
        lam_out, U_out = eigh_psd(S, eig_dtype)
        return cls.from_spectra(lam_out, U_out, lam_in, U_in, gamma, dtype=dtype)

    @classmethod
    def from_spectra(
        cls,
        lam_out: Tensor,
        U_out: Tensor,
        lam_in: Tensor,
        U_in: Tensor,
        gamma: float,
        *,
        dtype: torch.dtype = torch.float32,
    ) -> KroneckerProjector:
        """K-FAC projector from the factors' eigendecompositions (eigenvalues in decreasing order, ``d_out`` /
        ``d_in``; eigenvector columns ``d_out x d_out`` / ``d_in x d_in``), e.g. cached ones
        (:func:`crispedit.curvature.eigen.factor_eigh`): the mask keeps the entries of ``λ_out λ_inᵀ`` below the
        γ-energy cut. Equal to :meth:`from_factors` of the factors they decompose."""
        return cls(U_out, U_in, kronecker_keep_mask(lam_out, lam_in, gamma), dtype=dtype)

    @classmethod
    def from_eigenbasis(
        cls, U_out: Tensor, U_in: Tensor, eigvals: Tensor, gamma: float, *, dtype: torch.dtype = torch.float32
    ) -> KroneckerProjector:
        """Projector in a given Kronecker eigenbasis with per-entry eigenvalues ``eigvals``
        (``d_out x d_in``), e.g. the corrected eigenvalues of EK-FAC."""
        return cls(U_out, U_in, energy_keep_mask(eigvals, gamma), dtype=dtype)

    @classmethod
    def from_activation_covariance(
        cls, A: Tensor, gamma: float, *, dtype: torch.dtype = torch.float32, eig_dtype: torch.dtype = torch.float64
    ) -> KroneckerProjector:
        """Adam-NSCL: keep the low-energy eigen-directions of the layer-input covariance only."""
        lam_in, U_in = eigh_psd(A, eig_dtype)
        return cls.from_input_spectrum(lam_in, U_in, gamma, dtype=dtype)

    @classmethod
    def from_input_spectrum(
        cls, lam_in: Tensor, U_in: Tensor, gamma: float, *, dtype: torch.dtype = torch.float32
    ) -> KroneckerProjector:
        """Adam-NSCL's projector from the input covariance's eigendecomposition (``lam_in`` decreasing, ``d_in``;
        ``U_in`` ``d_in x d_in``): equal to :meth:`from_activation_covariance` of the matrix it decomposes."""
        keep = energy_keep_mask(lam_in.to(torch.float64), gamma)
        return cls(None, U_in, keep.reshape(1, -1), dtype=dtype)

    # -- operator ------------------------------------------------------------------------------
    def rotate(self, Q: Tensor) -> Tensor:
        """``(U_out^T Q U_in) * M`` in the projector's dtype (``(Q U_in) * M`` without ``U_out``)."""
        X = Q.to(self.dtype)
        if self.U_out is None:
            return (X @ self.U_in) * self.mask
        return (self.U_out.T @ X @ self.U_in) * self.mask

    def unrotate(self, C: Tensor) -> Tensor:
        """``U_out C U_in^T`` (``C U_in^T`` without ``U_out``), in the projector's dtype."""
        C = C.to(self.dtype)
        if self.U_out is None:
            return C @ self.U_in.T
        return self.U_out @ C @ self.U_in.T

    def project(self, Q: Tensor) -> Tensor:
        """``U_out ((U_out^T Q U_in) * M) U_in^T`` for ``Q`` of shape ``d_out x d_in`` (any strides), computed
        in ``self.dtype`` in the full or the low-rank form (:attr:`low_rank`), cast back to ``Q``'s dtype.
        ``Q`` itself is returned when nothing is masked.

        Under TF32 matrix products (:func:`rotation_precision`) the low-rank form never runs in TF32: it subtracts
        the masked part, so that part's rounding errors would stay in the step, while the full form masks after
        rounding. So there the full form runs in TF32 when :meth:`tf32_full_form` says it pays, else the low-rank
        form in float32."""
        if not self.low_rank or (self.r_in and tf32_gemms(Q) and self.tf32_full_form()):
            return self.unrotate(self.rotate(Q)).to(Q.dtype)
        with rotation_precision("fp32", Q.device):  # a no-op unless TF32 is on
            return self._low_rank(Q)

    def tf32_full_form(self) -> bool:
        """Whether, with TF32 matrix products, :meth:`project` runs the full form in TF32 (its FLOPs at most
        :data:`TF32_FULL_FORM_RATIO` times the low-rank form's) rather than the low-rank form in float32."""
        return self.flops_full <= TF32_FULL_FORM_RATIO * self.flops_low_rank

    def _low_rank(self, Q: Tensor) -> Tensor:
        """:meth:`project` in the low-rank form: ``Q`` minus its masked corner blocks."""
        if self.r_in == 0:
            return Q
        X = Q.to(self.dtype)
        out = X
        for rows, w, keep, out_first in self._blocks:
            V = self.U_in[:, :w]
            if self.U_out is None:
                removed = (X @ V).masked_fill_(keep, 0) @ V.T
            else:
                U = self.U_out[:, rows]
                if out_first:
                    removed = U @ (((U.T @ X) @ V).masked_fill_(keep, 0) @ V.T)
                else:
                    removed = (U @ (U.T @ (X @ V)).masked_fill_(keep, 0)) @ V.T
            out = out - removed
        return out.to(Q.dtype)

    def dense(self) -> Tensor:
        """The explicit projector matrix on column-major ``vec(Q)`` (tests only)."""
        if self.d_out < 0:
            raise ValueError("dense() needs a fixed d_out; build with U_out for tests")
        return super().dense()

    @property
    def kept_fraction(self) -> float:
        """Fraction of eigen-directions kept (1.0 for the identity)."""
        return float(self.mask.float().mean())

    @property
    def n_kept(self) -> int:
        """Number of kept directions of the ``d_out x d_in`` gradient space."""
        if self.U_out is None:
            return int(self.mask.sum()) * (self.d_out if self.d_out > 0 else 1)
        return int(self.mask.sum())

    def stats(self) -> dict:
        """Report entry: ``kept_fraction``, ``r_out`` / ``r_in`` (the masked corner; ``r_out`` is None
        without an output-side basis), ``split`` (the row split of the two-block form; 0 or ``r_out`` = one
        corner), ``form`` (``"low_rank"`` or ``"full"``, the one :meth:`project` uses) and ``flop_ratio``
        (low-rank FLOPs / full FLOPs per projection)."""
        ratio = self.flops_low_rank / self.flops_full if self.flops_full else 1.0
        return {
            "kept_fraction": round(self.kept_fraction, 6),
            "r_out": self.r_out,
            "r_in": self.r_in,
            "split": self.split if self.U_out is not None else None,
            "form": "low_rank" if self.low_rank else "full",
            "flop_ratio": round(ratio, 6),
        }

    def to(self, device: torch.device | str) -> KroneckerProjector:
        """The projector with its tensors on ``device`` (in place; returns ``self``)."""
        self.U_in = self.U_in.to(device)
        self.U_out = None if self.U_out is None else self.U_out.to(device)
        self.mask = self.mask.to(device)
        self._blocks = [(rows, w, keep.to(device), of) for rows, w, keep, of in self._blocks]
        return self


class DenseProjector(LayerProjector):
    """Projector onto the kept eigen-directions of an explicit curvature matrix acting on ``vec(Q)``.

    Used for exact Hessian / Gauss-Newton projections of small networks (the curvature study) and
    as ground truth in tests. ``project`` accepts a matrix (``d_out x d_in``, vectorised column-major)
    or a flat vector of the same size as the basis.
    """

    def __init__(
        self,
        U: Tensor,
        keep: Tensor,
        d_out: int | None = None,
        d_in: int | None = None,
        dtype: torch.dtype = torch.float64,
    ):
        self.U_kept = U[:, keep.to(U.device)].to(dtype).contiguous()
        self.dim = U.shape[0]
        self.d_out, self.d_in = (d_out or self.dim), (d_in or 1)
        self.dtype = dtype
        self._kept = int(keep.sum())

    @classmethod
    def from_matrix(
        cls,
        G: Tensor,
        gamma: float,
        d_out: int | None = None,
        d_in: int | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> DenseProjector:
        """Projector onto the low-energy eigen-directions of an explicit PSD curvature matrix ``G`` under
        ``gamma``."""
        evals, U = eigh_psd(G, torch.float64)
        return cls(U, energy_keep_mask(evals, gamma), d_out, d_in, dtype)

    def project(self, Q: Tensor) -> Tensor:
        """Project ``Q`` (matrix, column-major vectorised, or flat vector) onto the kept directions."""
        orig_dtype, shape = Q.dtype, Q.shape
        v = vec(Q) if Q.dim() == 2 else Q.reshape(-1)
        v = v.to(self.dtype)
        out = self.U_kept @ (self.U_kept.T @ v)
        out = out.to(orig_dtype)
        return unvec(out, shape[0], shape[1]) if Q.dim() == 2 else out.reshape(shape)

    def dense(self) -> Tensor:
        """The explicit projector matrix on column-major ``vec(Q)`` (tests only)."""
        return self.U_kept @ self.U_kept.T

    @property
    def kept_fraction(self) -> float:
        """Fraction of eigen-directions kept (1.0 for the identity)."""
        return self._kept / self.dim

    def to(self, device: torch.device | str) -> DenseProjector:
        """The projector with its tensors on ``device`` (in place; returns ``self``)."""
        self.U_kept = self.U_kept.to(device)
        return self


class AlternatingProjector(LayerProjector):
    """Symmetric alternation of projectors that each mask a different curvature in its own eigenbasis:
    ``T = (P_1 P_2 ⋯ P_m ⋯ P_2)^sweeps P_1`` for ``parts = (P_1, …, P_m)`` (same ``d_out x d_in``).

    One Kronecker mask cannot cover two curvatures each in its own eigenbasis; their kept subspaces meet in an
    intersection that has no Kronecker form. ``T`` is symmetric positive semidefinite with eigenvalues in
    ``[0, 1]``, its range lies in ``P_1``'s kept subspace exactly (the first part is never leaked into), and it
    tends to the orthogonal projector onto the intersection of every part's kept subspace as ``sweeps`` grows
    (von Neumann's alternating projections); with few sweeps a step may keep a little of a later part's masked
    directions, the leak :meth:`leak` measures. Being symmetric PSD, ``-T g`` is a descent direction for any
    gradient ``g``. Costs ``2 sweeps (m - 1) + 1`` part projections. No eigenbasis of its own (:meth:`rotate`
    refuses)."""

    def __init__(self, parts, sweeps: int = 1):
        parts = list(parts)
        if len(parts) < 2:
            raise ValueError("an alternating projector needs at least two parts")
        if any((p.d_out, p.d_in) != (parts[0].d_out, parts[0].d_in) for p in parts):
            raise ValueError("the parts of an alternating projector must act on the same weight shape")
        if int(sweeps) < 1:
            raise ValueError(f"sweeps must be at least 1, not {sweeps}")
        self.parts, self.sweeps = parts, int(sweeps)
        self.d_out, self.d_in = parts[0].d_out, parts[0].d_in

    def project(self, Q: Tensor) -> Tensor:
        """``T vec(Q)`` (class docstring) in float32 or better, returned in ``Q``'s dtype."""
        X = self.parts[0].project(Q if Q.dtype == torch.float64 else Q.float())
        inner = self.parts[1:] + self.parts[-2::-1]  # applied in this order: P_2, …, P_m, …, P_2, P_1
        for _ in range(self.sweeps):
            for part in inner:
                X = part.project(X)
        return X.to(Q.dtype)

    def leak(self, Q: Tensor) -> list[float]:
        """Per part, the share of ``T vec(Q)``'s squared norm that the part itself would remove (0 for the first
        part; 0 for every part when ``T`` is the exact projector onto the intersection)."""
        X = self.project(Q if Q.dtype == torch.float64 else Q.float())
        total = float(X.pow(2).sum())
        if total <= 0:
            return [0.0] * len(self.parts)
        return [float((X - p.project(X)).pow(2).sum()) / total for p in self.parts]

    @property
    def kept_fraction(self) -> float:
        """The fraction of directions every part keeps when the kept subspaces are in general position:
        ``max(0, Σ kept_i - (m - 1))``, a lower bound on the intersection's dimension over ``d_out d_in``."""
        return max(0.0, sum(p.kept_fraction for p in self.parts) - (len(self.parts) - 1))

    def stats(self) -> dict:
        """Report entry: ``kept_fraction`` (:attr:`kept_fraction`), ``form`` (``"alternating"``), ``sweeps`` and
        ``parts`` (each part's own :meth:`~LayerProjector.stats`)."""
        return {
            "kept_fraction": round(self.kept_fraction, 6),
            "form": "alternating",
            "sweeps": self.sweeps,
            "parts": [p.stats() for p in self.parts],
        }

    def to(self, device: torch.device | str) -> AlternatingProjector:
        """The projector with every part's tensors on ``device`` (in place; returns ``self``)."""
        for p in self.parts:
            p.to(device)
        return self
