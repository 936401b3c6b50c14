"""Option values of the curvature cache, torch-free so that the command line can offer them before torch is
imported."""

from __future__ import annotations

__all__ = ["CACHE_KINDS"]

CACHE_KINDS = ("kfac", "input")  # a curvature cache entry: K-FAC factors A and S, or the input covariance A alone
