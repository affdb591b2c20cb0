"""The random pieces workloads are built from, each a small frozen dataclass of parameters.

Everything draws from a caller's :class:`numpy.random.Generator`, so a workload is a pure
function of its seed, the same on every machine (see :meth:`LogNormal.sample`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["LogNormal", "poisson_arrivals"]


@dataclass(frozen=True)
class LogNormal:
    """A log-normal length or duration: ``median * exp(sigma * Z)``, ``Z ~ N(0, 1)``, clipped to
    ``[low, cap]``.

    The median is the parameter people quote for lengths; ``sigma`` sets the spread (the 90th
    percentile is ``median * exp(1.2816 * sigma)``, e.g. 3.6x the median at ``sigma = 1``).
    Clipping piles the clipped mass at the bounds instead of redrawing, which keeps a draw one
    vectorised call.
    """

    median: float
    sigma: float
    low: float = 1
    cap: float | None = None

    def __post_init__(self) -> None:
        if not self.median > 0:
            raise ValueError(f"LogNormal median must be > 0, got {self.median}")
        if self.sigma < 0:
            raise ValueError(f"LogNormal sigma must be >= 0, got {self.sigma}")
        if self.cap is not None and self.cap < self.low:
            raise ValueError(f"LogNormal cap {self.cap} is below low {self.low}")

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` float draws."""
        z = self.sigma * rng.standard_normal(size)
        # the C library's exp, not np.exp: numpy's AVX-512 exp differs from it in the last bit
        # of about 1 draw in 20, so the same seed gave different traces (and TTFTs) on machines
        # with and without AVX-512; numpy's other CPU paths call this exp
        x = self.median * np.fromiter(map(math.exp, z.tolist()), dtype=np.float64, count=size)
        return np.clip(x, self.low, self.cap if self.cap is not None else np.inf)

    def sample_int(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` draws rounded to whole tokens (``int64``, at least ``max(1, low)``)."""
        x = np.rint(self.sample(rng, size)).astype(np.int64)
        return np.maximum(x, max(1, int(np.ceil(self.low))))


def poisson_arrivals(rng: np.random.Generator, rate: float, size: int) -> np.ndarray:
    """Arrival times (s) of a Poisson process of ``rate`` events per second, starting at 0:
    exponential gaps with mean ``1 / rate``; the first arrival is at time 0."""
    if not rate > 0:
        raise ValueError(f"arrival rate must be > 0 per second, got {rate}")
    if size <= 0:
        return np.zeros(0)
    gaps = rng.exponential(1.0 / rate, size)
    gaps[0] = 0.0
    return np.cumsum(gaps)
