"""When each request is sent: Poisson, gamma (bursty) or all at once."""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from the start for `n` requests.

    Gaps are gamma-distributed with shape `burstiness` and mean 1/rate: burstiness 1 is a
    Poisson process, below 1 burstier, above 1 more regular. An infinite rate sends all at once.
    """
    if n < 0:
        raise ValueError("the number of requests must be >= 0")
    if burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError("--request-rate must be > 0 (or inf)")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    return np.cumsum(gaps).tolist()
