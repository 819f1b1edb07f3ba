"""Planner quality from lengths alone: fixed batching, transformers' samplers, ODB, oracle.

Every method turns one length array into a list of batches (arrays of sample indices,
in emission order); ``batch_metrics`` scores them with the definitions of DESIGN.md
("How to measure"). For two length dimensions (encoder-decoder) the budget bounds the
sum over dimensions: a batch costs B x (max source + max target).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..config import ODBConfig
from ..window import oracle_groups, plan_stream
from .workloads import encoder_decoder_lengths, synthetic_workloads

BUFFER_SIZES = (256, 512, 1024, 2048)
REBALANCE_GRAD_ACCUM = 8  # micro-batches per optimizer step given to BatchRebalanceSampler

try:  # transformers is a bench extra; the samplers are compared only where installed
    from transformers.trainer_pt_utils import LengthGroupedSampler
except ImportError:  # pragma: no cover - depends on the environment
    LengthGroupedSampler = None
try:
    from transformers.trainer_pt_utils import BatchRebalanceSampler
except ImportError:  # pragma: no cover - older transformers have no BatchRebalanceSampler
    BatchRebalanceSampler = None


def _subsample(x: np.ndarray, n: int, seed: int) -> np.ndarray:
    x = np.asarray(x, dtype=np.int64).reshape(len(x), -1)
    if len(x) <= n:
        return x
    return x[np.sort(np.random.default_rng(seed).choice(len(x), size=n, replace=False))]


def load_workloads(n: int, real: bool = True, seed: int = 0,
                   log: Callable[[str], None] = print) -> Dict[str, np.ndarray]:
    """name -> (n, D) int64 lengths: the public synthetic workloads plus the committed real ones.

    A real array longer than n is a seeded random subsample of n samples.
    """
    out = {name: x[:, None] for name, x in synthetic_workloads(n).items()}
    real_1d, real_2d = {}, {}
    if real:
        try:
            from .realdata import load_real_lengths
            real_1d["sharegpt-gpt2"] = load_real_lengths("sharegpt-gpt2")
            real_2d["gettext-en-de"] = load_real_lengths("gettext-en-de")
        except (ImportError, OSError, KeyError) as err:
            log(f"skip real workloads: {err!r}")
    for name, x in real_1d.items():
        out[name] = _subsample(x, n, seed)
    out["encdec-synthetic"] = encoder_decoder_lengths(n)
    for name, x in real_2d.items():
        out[name] = _subsample(x, n, seed)
    return out


# ---- metrics ---------------------------------------------------------------------------
def _ranks(x: np.ndarray) -> np.ndarray:
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return ((ends - counts + ends - 1) / 2.0)[inverse]


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation (average ranks for ties); 0 when one side is constant."""
    rx, ry = _ranks(np.asarray(x)), _ranks(np.asarray(y))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = float(np.sqrt((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum() / den) if den > 0 else 0.0


def batch_metrics(lengths: np.ndarray, batches: Sequence[np.ndarray], budget: int,
                  arrival: Optional[np.ndarray] = None) -> Dict[str, Any]:
    """DESIGN.md's figures for one plan.

    lengths: (n, D); batches: sample indices per batch in emission order; arrival:
    (n,) arrival position of each sample (ODB), for the displacement figure.
    """
    sizes = np.array([len(b) for b in batches], dtype=np.int64)
    flat = np.concatenate(batches).astype(np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    totals = lengths.sum(axis=1)
    maxima = np.maximum.reduceat(lengths[flat], starts, axis=0).sum(axis=1)
    costs = sizes * maxima
    real_per_batch = np.add.reduceat(totals[flat], starts)
    real = int(real_per_batch.sum())
    pairable = totals <= budget / 2  # samples that could share a batch with a copy of themselves
    alone = np.zeros(len(lengths), dtype=bool)
    alone[flat[starts[sizes == 1]]] = True
    out: Dict[str, Any] = {
        "steps": int(len(batches)),
        "useful_fill": real / (len(batches) * budget),
        "token_efficiency": real / float(costs.sum()),
        "budget_fill": float(costs.mean()) / budget,
        "over_budget_batches": float((costs > budget).mean()),
        "max_cost_over_budget": float(costs.max()) / budget,
        "mean_batch_size": float(sizes.mean()),
        "single_sample_fraction": float(alone[pairable].mean()) if pairable.any() else 0.0,
        "samples_emitted": int(len(flat)),
        "order_spearman": spearman(np.arange(len(batches)), real_per_batch / sizes),
    }
    if arrival is not None:
        out["mean_abs_displacement"] = float(np.abs(np.arange(len(flat)) - arrival[flat]).mean())
    return out


# ---- methods -----------------------------------------------------------------------------
def fixed_batch_size(lengths: np.ndarray, budget: int) -> int:
    """Largest B whose worst case (B x the workload's max padded length) fits the budget."""
    return max(1, int(budget // int(lengths.max(axis=0).sum())))


def _cut(order: Sequence[int], b: int) -> List[np.ndarray]:
    order = np.asarray(order, dtype=np.int64)
    return [order[i:i + b] for i in range(0, len(order), b)]


def fixed_batches(lengths: np.ndarray, b: int, seed: int) -> List[np.ndarray]:
    return _cut(np.random.default_rng(seed).permutation(len(lengths)), b)


def length_grouped_batches(lengths: np.ndarray, b: int, seed: int) -> List[np.ndarray]:
    sampler = LengthGroupedSampler(b, lengths=lengths.sum(axis=1).tolist(),
                                   generator=torch.Generator().manual_seed(seed))
    return _cut(list(iter(sampler)), b)


def rebalance_batches(lengths: np.ndarray, b: int, seed: int) -> List[np.ndarray]:
    # As Trainer builds it on one rank: effective batch = per-device batch x accumulation.
    sampler = BatchRebalanceSampler(lengths=lengths.sum(axis=1).tolist(),
                                    effective_batch_size=b * REBALANCE_GRAD_ACCUM, dp_size=1,
                                    grad_accum=REBALANCE_GRAD_ACCUM, seed=seed, drop_last=False)
    return [np.asarray(x, dtype=np.int64) for x in sampler]


def odb_batches(lengths: np.ndarray, cfg: ODBConfig, seed: int) -> Tuple[List[np.ndarray], np.ndarray, List[float]]:
    """ODB's plan over a shuffled arrival order, batches shuffled per window as EpochRun does.

    Returns (batches, arrival position of each sample, planning seconds per window).
    """
    arrival_order = np.random.default_rng(seed).permutation(len(lengths))
    arrival = np.empty(len(lengths), dtype=np.int64)
    arrival[arrival_order] = np.arange(len(lengths))
    batches: List[np.ndarray] = []
    times: List[float] = []
    windows = plan_stream(lengths[arrival_order], cfg)
    w = 0
    while True:
        t0 = time.perf_counter()
        planned = next(windows, None)
        if planned is None:
            break
        times.append(time.perf_counter() - t0)
        w += 1
        groups = planned.groups
        rng = np.random.default_rng([seed, 0, w])  # EpochRun._order: [seed, epoch, windows planned]
        batches.extend(arrival_order[groups[k]] for k in rng.permutation(len(groups)))
    return batches, arrival, times


def run_planning(workloads: Dict[str, np.ndarray], budget: int = 16384, buffer_sizes: Sequence[int] = BUFFER_SIZES,
                 seed: int = 0, progress: Callable[..., Any] = lambda it, **kw: it) -> Dict[str, Any]:
    """Plan every workload with every method; figures per workload and method."""
    result: Dict[str, Any] = {
        "token_budget": budget, "buffer_sizes": list(buffer_sizes), "seed": seed,
        "rebalance_grad_accum": REBALANCE_GRAD_ACCUM,
        "transformers_samplers": {"LengthGroupedSampler": LengthGroupedSampler is not None,
                                  "BatchRebalanceSampler": BatchRebalanceSampler is not None},
        "workloads": {},
    }
    for name in progress(list(workloads), desc="planning", unit="workload"):
        lengths = workloads[name]
        b = fixed_batch_size(lengths, budget)
        methods: Dict[str, Any] = {}
        t0 = time.perf_counter()
        oracle = oracle_groups(lengths, ODBConfig(token_budget=budget))
        methods["oracle"] = batch_metrics(lengths, oracle, budget)
        methods["oracle"]["plan_s"] = time.perf_counter() - t0
        del methods["oracle"]["order_spearman"]  # the oracle emits sorted by length
        methods["fixed"] = batch_metrics(lengths, fixed_batches(lengths, b, seed), budget)
        if LengthGroupedSampler is not None:
            methods["length_grouped"] = batch_metrics(lengths, length_grouped_batches(lengths, b, seed), budget)
        if BatchRebalanceSampler is not None:
            t0 = time.perf_counter()
            methods["batch_rebalance"] = batch_metrics(lengths, rebalance_batches(lengths, b, seed), budget)
            methods["batch_rebalance"]["plan_s"] = time.perf_counter() - t0
        for size in buffer_sizes:
            batches, arrival, times = odb_batches(lengths, ODBConfig(token_budget=budget, buffer_size=size), seed)
            m = batch_metrics(lengths, batches, budget, arrival)
            m.update(window_plan_ms_mean=1e3 * float(np.mean(times)), window_plan_ms_max=1e3 * float(np.max(times)),
                     plan_s=float(np.sum(times)),
                     # how many full batches one window holds: small values force under-filled batches
                     window_in_budgets=size * float(lengths.sum(axis=1).mean()) / budget)
            methods[f"odb-{size}"] = m
        for m in methods.values():
            m["ratio_to_oracle"] = m["useful_fill"] / methods["oracle"]["useful_fill"]
        result["workloads"][name] = {
            "samples": int(len(lengths)), "dims": int(lengths.shape[1]),
            "mean_length": [float(v) for v in lengths.mean(axis=0)],
            "max_length": [int(v) for v in lengths.max(axis=0)],
            "fixed_batch_size": b, "methods": methods,
        }
    return result
