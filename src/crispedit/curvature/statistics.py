"""K-FAC statistics of a layer's rows: the float64 running sums of ``a a^T`` and ``g g^T``
(:class:`FactorAccumulator`), the rows of a linear or convolutional layer's inputs and output gradients
(:func:`layer_rows`), and one forward/backward's capture of them (:func:`capture_io`, :func:`frozen`).

:func:`capture_io` hooks a set of modules, records their inputs and output gradients during one forward/backward,
and makes the lowest hooked output the leaf of the graph, so that with all parameters frozen the backward stops
there and computes no parameter gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributed import all_reduce_sum_, is_distributed
from .factors import KFACFactors

__all__ = ["add_gram_", "FactorAccumulator", "layer_rows", "capture_io", "frozen"]


def add_gram_(acc: Tensor, x: Tensor, panel: int = 256) -> Tensor:
    """``acc += x^T x`` in place (``acc``: ``d x d``, usually float64; ``x``: ``N x d``, products formed in
    ``x``'s dtype and widened as they are added). Only the upper block triangle is computed — one GEMM per
    ``panel``-row strip, ``x[:, i:i+p]^T x[:, i:]`` — and mirrored, which saves up to half the FLOPs of
    ``x^T x`` for wide layers. Returns ``acc``."""
    d = x.shape[1]
    if d <= panel:
        acc += x.T @ x
        return acc
    for i0 in range(0, d, panel):
        i1 = min(d, i0 + panel)
        blk = x[:, i0:i1].T @ x[:, i0:]  # (i1 - i0) x (d - i0): this strip's diagonal block and right of it
        acc[i0:i1, i0:] += blk
        if i1 < d:
            acc[i1:, i0:i1] += blk[:, i1 - i0 :].T
    return acc


class FactorAccumulator:
    """Running sums of ``a a^T`` and ``g g^T`` over rows, in float64."""

    def __init__(self, stat_dtype: torch.dtype = torch.float32):
        self.stat_dtype = stat_dtype
        self.A: dict[str, Tensor] = {}
        self.S: dict[str, Tensor] = {}
        self.rows: dict[str, int] = {}

    def add(self, name: str, a: Tensor, g: Tensor) -> None:
        """Add rows ``a`` (``N x d_in``) and ``g`` (``N x d_out``) of one layer."""
        if a.shape[0] != g.shape[0]:
            raise ValueError(f"{name}: {a.shape[0]} input rows but {g.shape[0]} gradient rows")
        if a.shape[0] == 0:
            return
        a = a.to(self.stat_dtype)
        g = g.to(self.stat_dtype)
        if name not in self.A:
            self.A[name] = torch.zeros(a.shape[1], a.shape[1], dtype=torch.float64, device=a.device)
            self.S[name] = torch.zeros(g.shape[1], g.shape[1], dtype=torch.float64, device=g.device)
            self.rows[name] = 0
        add_gram_(self.A[name], a)
        add_gram_(self.S[name], g)
        self.rows[name] += a.shape[0]

    def all_reduce(self, shapes: dict[str, tuple[int, int]], device: torch.device | str) -> None:
        """Sum the running sums and row counts over every process of the default ``torch.distributed``
        group, in place (nothing in a single process). ``shapes`` maps each layer, in the same order on
        every process, to ``(d_out, d_in)``: a process that saw no rows of a layer contributes zero
        ``d_in x d_in`` / ``d_out x d_out`` float64 sums on ``device``. Layers no process saw stay absent."""
        if not is_distributed():
            return
        names = list(shapes)
        rows = torch.tensor([self.rows.get(n, 0) for n in names], dtype=torch.int64, device=device)
        all_reduce_sum_(rows)
        for i, name in enumerate(names):
            d_out, d_in = shapes[name]
            A = self.A.get(name, torch.zeros(d_in, d_in, dtype=torch.float64, device=device))
            S = self.S.get(name, torch.zeros(d_out, d_out, dtype=torch.float64, device=device))
            all_reduce_sum_(A)
            all_reduce_sum_(S)
            if int(rows[i]) > 0:
                self.A[name], self.S[name], self.rows[name] = A, S, int(rows[i])

    def factors(
        self, layers: Sequence[str], meta: dict | None = None, out_dtype: torch.dtype = torch.float32
    ) -> KFACFactors:
        """The averaged factors of ``layers``: ``A = Σ a aᵀ / rows`` (``d_in x d_in``) and ``S = Σ g gᵀ / rows``
        (``d_out x d_out``) per layer, in ``out_dtype`` on the CPU; ``n_tokens`` is the largest row count.
        Raises ``RuntimeError`` when a layer saw no rows."""
        missing = [n for n in layers if n not in self.A]
        if missing:
            raise RuntimeError(f"no statistics were collected for {missing} (no valid tokens?)")
        counts = {self.rows[n] for n in layers}
        n = max(counts)
        A = {k: (self.A[k] / self.rows[k]).to(out_dtype).cpu() for k in layers}
        S = {k: (self.S[k] / self.rows[k]).to(out_dtype).cpu() for k in layers}
        return KFACFactors(A, S, n, dict(meta or {}))


def layer_rows(module: nn.Module, inp: Tensor) -> Tensor:
    """Inputs of ``module`` as rows ``a`` such that the layer computes ``W_mat a`` per row.

    Linear / Conv1D keep their leading dims (``... x d_in``); Conv2d inputs are unfolded into patches
    (``B x L x C_in k_h k_w``) matching ``weight.reshape(C_out, -1)``.
    """
    if isinstance(module, nn.Conv2d):
        patches = F.unfold(
            inp, module.kernel_size, dilation=module.dilation, padding=module.padding, stride=module.stride
        )
        return patches.transpose(1, 2)
    return inp


def _grad_rows(module: nn.Module, grad: Tensor) -> Tensor:
    if isinstance(module, nn.Conv2d):
        return grad.flatten(2).transpose(1, 2)  # B x L x C_out
    return grad


@dataclass
class _Captured:
    inputs: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)


@contextlib.contextmanager
def capture_io(modules: dict[str, nn.Module]) -> Iterator[dict[str, _Captured]]:
    """Record inputs (as rows, see :func:`layer_rows`) and output gradients of ``modules``.

    A module output that does not require grad (the lowest hooked layer when all parameters are
    frozen) is replaced by a detached leaf that does, so backward runs from the loss down to the
    lowest hooked layer only.
    """
    store = {name: _Captured() for name in modules}
    handles = []

    def make_hook(name: str, module: nn.Module) -> Callable:
        """A forward hook recording the input rows and output gradients of layer ``name`` into ``store``."""

        def hook(mod, args, output):
            """Forward hook: record the input rows of ``name`` and hook its output's gradient (the output made
            a grad-requiring leaf first if need be); returns that output."""
            store[name].inputs.append(layer_rows(mod, args[0].detach()))
            if not output.requires_grad:
                output = output.detach().requires_grad_(True)

            def grad_hook(g: Tensor) -> None:
                """Tensor hook: record the output gradient ``g`` of ``name`` as rows (``... x d_out``)."""
                store[name].grads.append(_grad_rows(mod, g.detach()))

            output.register_hook(grad_hook)
            return output

        return hook

    try:
        for name, module in modules.items():
            handles.append(module.register_forward_hook(make_hook(name, module)))
        yield store
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def frozen(model: nn.Module) -> Iterator[None]:
    """Temporarily set ``requires_grad=False`` on every parameter."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, f in flags:
            p.requires_grad_(f)
