"""Per-token rows of the edit layers' inputs and output gradients, from one backward of a loss per batch.

UltraEdit's ridge solve (``methods/ultraedit/editor.py``: the rows ``[h‖g]`` at the target-predicting positions of
the edit contexts) and MEND's gradient transform (``methods/mend/net.py``: the factors ``(u, δ)`` of every
token of ``prompt + " " + target``) take these rows; each gives its own batches, loss and positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from ..curvature.statistics import capture_io, frozen
from ..errors import CrispEditError

__all__ = ["input_gradient_rows"]


def input_gradient_rows(
    model: nn.Module,
    layers: dict[str, nn.Module],
    batches: Iterable,
    loss_and_positions: Callable[[object], tuple[Tensor, Tensor]],
    *,
    what: str,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> dict[str, tuple[Tensor, Tensor]]:
    """``(H, G)`` per edit layer (name -> module in ``layers``): its inputs (``N x d_in``) and the gradients of
    the loss w.r.t. its outputs (``N x d_out``) at the positions each batch marks, rows in batch order, as
    ``dtype`` on ``device`` (``None``: where they were computed).

    For each of ``batches`` ``loss_and_positions(batch)`` runs the model and returns ``(loss, positions)``: a
    scalar whose gradient is taken once, and a boolean ``B x T'`` mask over the first ``T'`` positions of the
    batch's sequences. The model's parameters get no gradient; a layer that runs more than once in one forward
    is a one-line :class:`CrispEditError` naming ``what`` (the method)."""
    out: dict[str, tuple[list, list]] = {n: ([], []) for n in layers}
    with frozen(model), torch.enable_grad():
        for batch in batches:
            with capture_io(layers) as store:
                loss, pos = loss_and_positions(batch)
                loss.backward()
            for n in layers:
                cap = store[n]
                if len(cap.inputs) != 1 or len(cap.grads) != 1:
                    raise CrispEditError(f"{what}: layer {n} ran {len(cap.inputs)} times in one forward")
                t = pos.shape[1]
                out[n][0].append(cap.inputs[0][:, :t][pos].to(device=device, dtype=dtype))
                out[n][1].append(cap.grads[0][:, :t][pos].to(device=device, dtype=dtype))
    return {n: (torch.cat(h), torch.cat(g)) for n, (h, g) in out.items()}
