"""Per-phase timing of the steps of the projected loop (:func:`.loop.projected_finetune`).

The loop calls every part of a step through ``timer.timed(name, fn)`` — one wrapper, applied once when the loop
is set up, that charges each call of ``fn`` to phase ``name`` — and brackets every step with
``timer.start_step()`` / ``timer.end_step()``. By default the loop uses :data:`NULL_TIMER`, whose ``timed``
hands ``fn`` back unwrapped and whose other methods do nothing (nothing at all per step), so the figures a
:class:`StepTimer` reports are of the loop every edit runs, not of a re-implementation
(``benchmarks/bench_projection.py --profile``).

Phases of a step, in loop order: ``forward`` (the edit loss, fast path or plain), ``bookkeeping`` (the
on-device skip test and the loss kept for the epoch mean; nothing is read back to the host), ``skip_read``
(the skip test read on the host: the loop's only read in a step, on its host path — the CPU default — only),
``zero_grad``, ``backward``, ``allreduce`` (gradients summed over processes, under ``torch.distributed``
only), ``copies`` (the weights kept before an update-projected step), ``projection`` (the gradient, or the
update after the step), ``optimizer`` (the Adam step), ``drift`` (the ``--max-drift`` trust region). The
breakdown groups them as forward, backward, projection, optimizer and *other* (everything else), and also
reports what no phase covers (``unaccounted``: the loop's own Python between phases).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

__all__ = ["StepTimer", "NULL_TIMER", "MAIN_PHASES", "OTHER_PHASES"]

MAIN_PHASES = ("forward", "backward", "projection", "optimizer")
OTHER_PHASES = ("bookkeeping", "skip_read", "zero_grad", "allreduce", "copies", "drift", "keep")
F = TypeVar("F", bound=Callable)


class _NullTimer:
    """The timer the loop uses when none is asked for: every method is a no-op."""

    _null = contextlib.nullcontext()
    enabled = False

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """A shared, reusable no-op context manager."""
        return self._null

    def timed(self, name: str, fn: F) -> F:
        """``fn`` itself: nothing is timed."""
        return fn

    def start_step(self) -> None:
        """Nothing."""

    def end_step(self, skipped: bool = False) -> None:
        """Nothing."""


NULL_TIMER = _NullTimer()


class StepTimer:
    """Synchronised wall-clock times (seconds, ``time.perf_counter``) of every phase of every step.

    ``steps`` holds one dict per Adam step (``phase -> seconds`` plus ``"step"``, the whole step from
    :meth:`start_step` to :meth:`end_step`); ``skipped`` the same for batches skipped below ``skip_loss``
    (forward and bookkeeping only). On CUDA every boundary synchronises the device first, so a phase is
    charged for its own kernels (this removes the overlap of host and device work; the CPU path is
    unaffected). ``record_functions=True`` also opens a ``torch.profiler.record_function("crispedit.<phase>")``
    range per phase, for a ``torch.profiler`` trace of the real loop.
    """

    enabled = True

    def __init__(self, device: torch.device | str | None = None, *, record_functions: bool = False):
        self.device = torch.device(device) if device is not None else None
        self.record_functions = record_functions
        self.steps: list[dict[str, float]] = []
        self.skipped: list[dict[str, float]] = []
        self._cur: dict[str, float] | None = None
        self._t0 = 0.0

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start_step(self) -> None:
        """Open a step (synchronises first)."""
        self._sync()
        self._cur = {}
        self._t0 = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the enclosed code to ``name`` in the open step (seconds add up if a phase repeats)."""
        self._sync()
        t = time.perf_counter()
        try:
            if self.record_functions:
                with torch.profiler.record_function(f"crispedit.{name}"):
                    yield
            else:
                yield
        finally:
            self._sync()
            if self._cur is not None:
                self._cur[name] = self._cur.get(name, 0.0) + (time.perf_counter() - t)

    def timed(self, name: str, fn: F) -> F:
        """``fn`` with every call charged to phase ``name`` (:meth:`phase`)."""

        def charged(*args, **kwargs):
            """``fn(*args, **kwargs)`` inside phase ``name``."""
            with self.phase(name):
                return fn(*args, **kwargs)

        return charged

    def end_step(self, skipped: bool = False) -> None:
        """Close the open step and store it (in :attr:`skipped` for a batch below ``skip_loss``)."""
        self._sync()
        if self._cur is None:
            return
        self._cur["step"] = time.perf_counter() - self._t0
        (self.skipped if skipped else self.steps).append(self._cur)
        self._cur = None

    def breakdown(self, discard: int = 0) -> dict:
        """Mean seconds per Adam step of each phase over ``steps[discard:]``: ``forward``, ``backward``,
        ``projection``, ``optimizer``, ``other`` (the sum of :data:`OTHER_PHASES`), ``unaccounted`` (step time
        minus every timed phase) and ``step``; ``other_parts`` splits ``other``; ``steps`` is the count and
        ``step_median`` the median step (seconds). Empty dict when no step was kept."""
        rows = self.steps[discard:]
        if not rows:
            return {}
        n = len(rows)

        def mean(key: str) -> float:
            """Mean seconds of phase ``key`` over the kept steps (0 where a step did not time it)."""
            return sum(r.get(key, 0.0) for r in rows) / n

        out = {k: mean(k) for k in MAIN_PHASES}
        parts = {k: mean(k) for k in OTHER_PHASES if any(k in r for r in rows)}
        out["other"] = sum(parts.values())
        out["step"] = mean("step")
        out["unaccounted"] = out["step"] - sum(out[k] for k in MAIN_PHASES) - out["other"]
        out["other_parts"] = parts
        out["steps"] = n
        out["step_median"] = statistics.median(r["step"] for r in rows)
        return out
