"""Steps per epoch, estimated once from sample lengths (for ``len(loader)``).

The loader plans online, window by window, so the offline oracle (all lengths sorted,
cut greedily) miscounts it: it packs better than any window, and scaled up from a
small probe it counts the probe's few batches as if the epoch were cut like them (up
to 5.8x the real count on short translation pairs). The estimate instead runs the
loader's own planning simulation, ``odb.plan.windows.window.plan_stream``, on ``n_samples`` lengths:

* known lengths (at least ``n_samples`` of them): a seeded shuffle of them, cut into
  shards of ``n_samples`` (one rank's share when there are more);
* a probe of fewer samples: ``n_samples`` lengths drawn from it with replacement
  (``bootstrap_lengths``);
* past ``SIMULATE_MAX / D`` samples (D length dimensions) only that many are simulated
  (ramp and final window included); the rest are counted at the rate of the second
  half of the full windows, which keeps the cost under a second.

What is left with a probe is its sampling error: the step count is close to the sum
of per-sample shares ``1 / copies_that_fit`` (``step_shares``), which a probe of ``m``
samples estimates to about ``cv(share) / sqrt(m)``. The default probe reads
``DEFAULT_PROBE`` samples and then as many as ``probe_size`` asks for (error
``REL_ERROR``): ~512 for log-normal lengths, ~1,100 at CV 1, thousands for a Pareto
tail or real translation pairs. tests/plan/test_estimate.py measures the errors.

Oversize samples (no copy fits the budget) are one step each unless
``cfg.oversize == "skip"``; "error" counts as "alone" (the estimate never raises on
them). ``len(loader)`` counts micro-batches, so ``gradient_accumulation_steps`` plays no
part. A budget schedule is not followed: the estimate plans at ``cfg.token_budget``.

Under DDP every rank plans its own shard (``n_samples`` is per rank) and all ranks run
the same number of steps per window: the fewest while ranks can defer, the most once
a rank's data ends, so the epoch lasts as long as its rank with the most groups
(``odb.epoch.simulate.simulate_ranks`` gave exactly the maximum of the ranks' single-rank
counts on the benchmark workloads). The estimate simulates one shard (with known
lengths for several shards, the mean of up to ``world_size`` of them) and adds the
expected excess of the most loaded of ``world_size`` shards over the mean:
``sqrt(2 ln W) x sqrt(n) x std(share)``, a shard's count being a sum of ``n`` shares.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from odb.plan.costs.cost import CostModel
from odb.plan.windows.window import plan_stream, window_limits

if TYPE_CHECKING:  # plan/ is pure numpy: the config is only read, never imported at run time
    from odb.config import ODBConfig

SIMULATE_MAX = 200_000  # samples simulated at most; beyond, the steady-state rate is extrapolated
DEFAULT_PROBE = 512  # pilot probe; probe_size says when to read more
REL_ERROR = 0.03  # target relative standard error of a probed estimate (10% is 3.3 of them)


def estimate_steps(lengths: np.ndarray, n_samples: int, cfg: ODBConfig, *, world_size: int = 1,
                   seed: int = 0) -> int:
    """Steps (micro-batches) one rank runs in an epoch of ``n_samples`` samples.

    Args:
        lengths: (m,) or (m, D) lengths: all samples (m >= n_samples), or a probe of
            m < n_samples of them, which is bootstrapped to n_samples.
        n_samples: samples this rank reads in an epoch (the sampler's length).
        cfg: the loader's config.
        world_size: ranks that align their steps (see the module docstring).
        seed: seed of the shuffle or bootstrap; the answer is deterministic.

    Example:
        >>> from odb.config import ODBConfig
        >>> cfg = ODBConfig(token_budget=4096)
        >>> x = np.random.default_rng(0).lognormal(6, 0.5, 5000).astype(int)
        >>> estimate_steps(x, 5000, cfg)   # all lengths known: the loader's plan, simulated
        607
        >>> estimate_steps(x[:512], 5000, cfg)   # a probe of 512, bootstrapped to 5000
        599
        >>> estimate_steps(x, 2500, cfg, world_size=2)   # per rank, 2 ranks of 2500 samples
        309
    """
    lengths = _as_2d(lengths)
    n, m = int(n_samples), len(lengths)
    if n <= 0 or m == 0:
        return 0
    cfg = cfg.replace(image_patches_key=None, max_image_patches=None, image_patch_cost=0.0, budget_schedule=None)
    rng = np.random.default_rng(seed)
    limit = SIMULATE_MAX // lengths.shape[1]  # planning several dimensions costs more per sample
    n_sim = min(n, limit)
    if m >= n:
        shards = max(1, min(world_size, m // n, limit // n_sim))
        order = rng.permutation(m)
        steps = float(np.mean([_simulate(lengths[order[k * n:k * n + n_sim]], n, cfg) for k in range(shards)]))
    else:
        steps = _simulate(bootstrap_lengths(lengths, n_sim, rng), n, cfg)
    if world_size > 1:
        share = step_shares(lengths, cfg)
        steps += math.sqrt(2.0 * math.log(world_size) * n) * float(share.std())
    return max(1, int(math.ceil(steps - 1e-9)))


def step_shares(lengths: np.ndarray, cfg: ODBConfig) -> np.ndarray:
    """Each sample's share of a step, ``1 / copies_that_fit`` (oversize: 1, or 0 under "skip").

    Their sum is a lower bound on the steps (no padding); their spread sets a probe's error.

    Example:
        >>> from odb.config import ODBConfig
        >>> step_shares(np.array([10, 25, 200]), ODBConfig(token_budget=100)).tolist()
        [0.1, 0.25, 1.0]
    """
    cost = CostModel.from_config(cfg)
    fits = cost.copies_that_fit(cost.pad(_as_2d(lengths)), None)
    over = 0.0 if cfg.oversize == "skip" else 1.0
    return np.where(fits > 0, 1.0 / np.maximum(fits, 1), over)


def probe_size(probe: np.ndarray, n_samples: int, cfg: ODBConfig, rel_error: float = REL_ERROR) -> int:
    """Samples a probe needs for a relative standard error of ``rel_error``, judged from ``probe``.

    ``cv(share)^2 / m x (1 - m / n)`` is the squared error of a probe of ``m`` of ``n``
    samples. Read more samples while the answer exceeds the probe (re-asking with the
    larger probe, since a small one tends to miss a heavy tail); never above n_samples.

    Example:
        >>> from odb.config import ODBConfig
        >>> cfg = ODBConfig(token_budget=16384)
        >>> x = np.random.default_rng(0).lognormal(6.5, 0.3, 512).astype(int)
        >>> probe_size(x, 100_000, cfg)   # narrow lengths: the pilot is plenty
        512
        >>> probe_size(16 * (1 + np.random.default_rng(0).pareto(1.2, 512)), 100_000, cfg) > 2000
        True
    """
    share = step_shares(probe, cfg)
    m, n = len(share), max(int(n_samples), 0)
    if m == 0:
        return min(DEFAULT_PROBE, n)
    if n <= m or share.mean() == 0:
        return min(m, n)
    cv2 = share.var() / share.mean() ** 2
    need = 1.0 / (rel_error ** 2 / max(cv2, 1e-12) + 1.0 / n)
    return int(min(n, max(m, math.ceil(need))))


def bootstrap_lengths(probe: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` rows drawn from the (m, D) ``probe`` with replacement; with D > 1, jittered.

    One dimension is a plain bootstrap (sorted neighbours in a window are near-equal
    anyway; smoothing moved mass across the budget's fit boundaries and biased ShareGPT
    by up to 6%). With several dimensions a plain bootstrap undercounts steps (by ~10%
    for encoder-decoder pairs at m = 128): each probed pair recurs n/m times and
    identical pairs pad no dimension, while real neighbours differ in both lengths. So
    each draw moves in log space by a Gaussian kernel with the probe's covariance
    (Silverman's bandwidth; source and target move together as they do in the data),
    shrunk to keep that covariance, then is rounded and clipped to the probe's range
    per dimension (lengths clipped at a maximum stay within it).

    Example:
        >>> x = bootstrap_lengths(np.array([[10, 20], [20, 20], [40, 30]]), 1000, np.random.default_rng(0))
        >>> x.shape, bool((x >= [10, 20]).all() and (x <= [40, 30]).all()), len(np.unique(x, axis=0)) > 3
        ((1000, 2), True, True)
    """
    probe = _as_2d(probe)
    m, dims = probe.shape
    rows = rng.integers(0, m, size=n)
    if dims == 1 or m < 2:
        return probe[rows]
    logs = np.log(np.maximum(probe, 1)).astype(np.float64)
    mu = logs.mean(axis=0)
    root = np.linalg.cholesky(np.cov(logs, rowvar=False, bias=True) + 1e-12 * np.eye(dims))
    h = (4.0 / (dims + 2)) ** (1.0 / (dims + 4)) * m ** (-1.0 / (dims + 4))
    draws = logs[rows] + h * rng.standard_normal((n, dims)) @ root.T
    draws = mu + (draws - mu) / math.sqrt(1.0 + h * h)
    return np.clip(np.rint(np.exp(draws)).astype(np.int64), probe.min(axis=0), probe.max(axis=0))


def _as_2d(lengths: np.ndarray) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    return lengths[:, None] if lengths.ndim == 1 else lengths


def _simulate(stream: np.ndarray, n: int, cfg: ODBConfig) -> float:
    """Steps of plan_stream on ``stream``, extrapolated to ``n`` samples at the steady-state rate."""
    count_over = cfg.oversize != "skip"
    windows = [(len(w.groups) + (len(w.oversize) if count_over else 0), w.new_samples)
               for w in plan_stream(stream, cfg)]
    steps = float(sum(k for k, _ in windows))
    if n <= len(stream):
        return steps
    # Count the rest at the rate of the second half of the full windows (past the ramp,
    # with a settled carry); with none, at the prefix's own rate.
    start, full = 0, []
    for k, (planned, size) in enumerate(windows[:-1]):
        cap, cap_tokens = window_limits(cfg, k, len(stream) - start)
        start += size
        if cap >= cfg.buffer_size or size < cap:  # not cut short by the ramp
            full.append((size, planned))
    tail = full[len(full) // 2:]
    samples = sum(size for size, _ in tail)
    rate = sum(k for _, k in tail) / samples if samples else steps / len(stream)
    return steps + rate * (n - len(stream))
