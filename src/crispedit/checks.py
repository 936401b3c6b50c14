"""Checks of the numbers a user gives (gamma, counts, learning rates, seeds) and of the tensors about to be
saved: each returns the checked value or raises a one-line :class:`~crispedit.errors.CrispEditError` naming the
input.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import CrispEditError


def check_gamma(gamma: float, what: str = "gamma") -> float:
    """``gamma`` as a float strictly inside (0, 1) (one-line error naming ``what`` otherwise)."""
    try:
        g = float(gamma)
    except (TypeError, ValueError):
        raise CrispEditError(f"{what} must be a number in (0, 1), got {gamma!r}") from None
    if not (0.0 < g < 1.0):
        raise CrispEditError(f"{what} must lie strictly between 0 and 1, got {g}")
    return g


def check_positive_int(name: str, value: Any) -> int:
    """``value`` as a positive int (an integral float or numeric string is accepted); one-line error naming
    ``name`` otherwise."""
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise CrispEditError(f"{name} must be a positive integer, got {value!r}") from None
    if v != value and not (isinstance(value, str) and str(v) == value.strip()):
        if not (isinstance(value, float) and value.is_integer()):
            raise CrispEditError(f"{name} must be a positive integer, got {value!r}")
    if v <= 0:
        raise CrispEditError(f"{name} must be a positive integer, got {value!r}")
    return v


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an int within ``[lo, hi]`` (either bound optional); one-line error naming ``name``
    otherwise (non-integers, booleans and integral floats out of range included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise CrispEditError(f"{name} must be an integer, got {value!r}")
    try:
        v = int(value)
    except (TypeError, ValueError, OverflowError):
        raise CrispEditError(f"{name} must be an integer, got {value!r}") from None
    if isinstance(value, float) and not value.is_integer():
        raise CrispEditError(f"{name} must be an integer, got {value!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = (
            f"between {lo} and {hi}"
            if lo is not None and hi is not None
            else ("non-negative" if lo == 0 else f"at least {lo}" if lo is not None else f"at most {hi}")
        )
        raise CrispEditError(f"{name} must be {rng}, got {value!r}")
    return v


def check_float(
    name: str,
    value: Any,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    """``value`` as a finite float within the given bounds (open or closed); one-line error naming ``name``
    otherwise — ``inf`` and ``nan`` are always refused."""
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        raise CrispEditError(f"{name} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(v):
        raise CrispEditError(f"{name} must be a finite number, got {value!r}")
    bad_lo = lo is not None and (v <= lo if lo_open else v < lo)
    bad_hi = hi is not None and (v >= hi if hi_open else v > hi)
    if bad_lo or bad_hi:
        if lo is not None and hi is not None:
            rng = f"lie in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        elif lo == 0:
            rng = "be positive" if lo_open else "be non-negative"
        elif lo is not None:
            rng = f"be {'>' if lo_open else '>='} {lo:g}"
        else:
            rng = f"be {'<' if hi_open else '<='} {hi:g}"
        raise CrispEditError(f"{name} must {rng}, got {value!r}")
    return v


MAX_LR = 1.0  # an Adam step of more than 1 per weight destroys any model; larger values are typos


def check_lr(name: str, value: Any) -> float:
    """``value`` as an Adam learning rate: a finite number in ``(0, MAX_LR]`` (one-line error naming ``name``
    otherwise). What ``edit --lr`` and ``mend train --lr`` accept."""
    return check_float(name, value, 0.0, MAX_LR, lo_open=True)


SEED_MAX = 2**32 - 1  # numpy's and most RNGs' limit; torch takes more, but a seed must work everywhere


def check_finite_tensors(tensors: dict, what: str) -> None:
    """Refuse (one-line error naming the first offending tensor) when any tensor in ``tensors`` (name ->
    tensor) holds ``inf`` or ``nan`` — called before anything with those values is saved."""
    bad = [name for name, t in tensors.items() if t.is_floating_point() and not bool(t.isfinite().all())]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CrispEditError(
            f"{what} left non-finite weights (inf/nan) in {bad[0]}{more}; nothing was saved — "
            "lower --lr or check the model and the inputs"
        )
