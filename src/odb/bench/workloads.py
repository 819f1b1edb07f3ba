"""The synthetic benchmark workloads (lengths only, deterministic)."""

from __future__ import annotations

from typing import Dict

import numpy as np

MIN_LEN, MAX_LEN = 16, 8192

# name -> (mean, coefficient of variation) of a log-normal length distribution.
LOGNORMAL = {"lognormal-cv0.29": (700.0, 0.29), "lognormal-cv0.48": (1200.0, 0.48), "lognormal-cv1.00": (900.0, 1.00)}
# name -> shape a of a heavy-tailed Pareto length distribution with minimum 16.
PARETO = {"pareto-a1.2": 1.2}


def lognormal_lengths(mean: float, cv: float, n: int, seed: int = 0, max_len: int = MAX_LEN) -> np.ndarray:
    """n lengths from a log-normal with this mean and CV, clipped to [16, max_len].

    Example:
        >>> lognormal_lengths(700, 0.29, 3).shape
        (3,)
    """
    sigma2 = np.log1p(cv * cv)
    mu = np.log(mean) - sigma2 / 2
    rng = np.random.default_rng(seed)
    x = rng.lognormal(mu, np.sqrt(sigma2), size=n)
    return np.clip(np.rint(x), MIN_LEN, max_len).astype(np.int64)


def pareto_lengths(a: float, n: int, seed: int = 0) -> np.ndarray:
    """n heavy-tailed lengths ``16 x (1 + Lomax(a))`` (a Pareto with minimum 16), clipped to [16, 8192].

    With a = 1.2 most samples are short (median ~28) while a few reach the clip, so one
    fixed batch size must be sized for 8192 tokens.

    Example:
        >>> x = pareto_lengths(1.2, 1000)
        >>> int(x.min()) >= 16 and int(x.max()) <= 8192
        True
    """
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(MIN_LEN * (1.0 + rng.pareto(a, size=n))), MIN_LEN, MAX_LEN).astype(np.int64)


def encoder_decoder_lengths(n: int, seed: int = 0) -> np.ndarray:
    """(n, 2) source/target lengths: source mean 40, CV 0.6; target = source x 1.1 +-15%."""
    src = lognormal_lengths(40.0, 0.6, n, seed)
    rng = np.random.default_rng(seed + 1)
    tgt = np.rint(src * 1.1 * (1.0 + rng.normal(0.0, 0.15, size=n)))
    return np.stack([src, np.clip(tgt, 1, MAX_LEN)], axis=1).astype(np.int64)


def synthetic_workloads(n: int = 20000, seed: int = 0) -> Dict[str, np.ndarray]:
    out = {name: lognormal_lengths(m, cv, n, seed) for name, (m, cv) in LOGNORMAL.items()}
    out.update({name: pareto_lengths(a, n, seed) for name, a in PARETO.items()})
    return out
