"""Time plan_window per pooled sample: the O(n x batch size) DP it had before, and now.

Each workload is one pool of samples planned as a non-final window (the DP path, with
carry_limit = half the pool, as PoolPlanner passes for a window of that size). The
figure is the median of --repeats calls of the whole plan_window, divided by the pool
size. "before" is the planner as it was before the sliding-window DP, copied below so
the comparison does not move when planner.py does. The last column says whether both
return the same plan, or ("tie") other runs of the same DP value: exact ties, which the
new DP gives to the shortest run and the old one to whichever float rounding favoured.

    python benchmarks/planning_speed.py                      # every workload, pools of 2,000 and 20,000
    python benchmarks/planning_speed.py --sizes 20000 --only translation --no-before
    python benchmarks/planning_speed.py --profile translation  # cProfile of one plan_window call
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from odb.bench.workloads import LOGNORMAL, MAX_LEN, encoder_decoder_lengths, lognormal_lengths
from odb.plan.costs.cost import CostModel
from odb.plan.windows.planner import plan_window, sort_order
from odb.plan.windows.pool_plan import PoolPlan

BUDGET = 16384


# --------------------------------------------------------------------------- reference (before)
def _ref_greedy_segments(counts: np.ndarray, multiple: int) -> List[tuple]:
    segs, i, n = [], 0, len(counts)
    while i < n:
        b = int(counts[i])
        if b >= multiple:
            b -= b % multiple
        b = max(b, 1)
        segs.append((i, i + b))
        i += b
    return segs


def _ref_dp_segments(tokens, counts, ideal, efficiency, multiple) -> List[tuple]:
    n = len(tokens)
    cum = np.concatenate(([0.0], np.cumsum(tokens, dtype=np.float64)))
    scale = 1.0 / efficiency
    best = np.zeros(n + 1)
    take = np.zeros(n, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        best[i] = best[i + 1]
        b_max = int(counts[i])
        if b_max <= 0:
            continue
        if multiple == 1 or b_max < multiple:
            sizes = np.arange(1, b_max + 1)
            vals = scale * (cum[i + 1:i + b_max + 1] - cum[i]) - ideal[i] + best[i + 1:i + b_max + 1]
        else:
            sizes = np.arange(multiple, b_max + 1, multiple)
            vals = scale * (cum[i + sizes] - cum[i]) - ideal[i] + best[i + sizes]
        k = int(np.argmax(vals))
        if vals[k] >= best[i] - 1e-6:
            best[i] = vals[k]
            take[i] = sizes[k]
    segs, i = [], 0
    while i < n:
        if take[i]:
            segs.append((i, i + int(take[i])))
            i += int(take[i])
        else:
            i += 1
    return segs


def _ref_drain_carry(runs, tokens, ideal, pad_s, patch_s, cost, carry_limit):
    taken = np.zeros(len(tokens), dtype=bool)
    for r in runs:
        taken[r] = True
    carried = np.flatnonzero(~taken)
    excess = len(carried) - carry_limit
    if excess <= 0:
        return []
    sub_patches = None if patch_s is None else patch_s[carried]
    sub_counts = cost.max_counts_sorted(pad_s[carried], sub_patches)
    cut = _ref_greedy_segments(sub_counts, cost.multiple)
    quality = np.array([tokens[carried[s:e]].sum() / max(ideal[carried[s]], 1.0) for s, e in cut])
    extra = []
    for k in np.argsort(-quality, kind="stable"):
        if excess <= 0:
            break
        s, e = cut[k]
        extra.append(carried[s:e])
        excess -= e - s
    return extra


def reference_plan_window(lengths, ids, cost: CostModel, *, final: bool, pack_efficiency: float = 0.95,
                          carry_limit: int = 512, patches: Optional[np.ndarray] = None) -> PoolPlan:
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim == 1:
        lengths = lengths[:, None]
    ids = np.asarray(ids)
    cost.check_dims(lengths.shape[1])
    padded = cost.pad(lengths)
    fits = cost.copies_that_fit(padded, patches)
    oversize = np.flatnonzero(fits == 0)
    ok = np.flatnonzero(fits > 0)
    if len(ok) == 0:
        return PoolPlan([], np.empty(0, dtype=np.int64), oversize)
    order = ok[sort_order(padded[ok], ids[ok])]
    pad_s = padded[order]
    patch_s = None if patches is None else np.asarray(patches)[order]
    counts = cost.max_counts_sorted(pad_s, patch_s)
    if final:
        runs = [np.arange(s, e) for s, e in _ref_greedy_segments(counts, cost.multiple)]
    else:
        tokens = lengths[order].sum(axis=1).astype(np.float64)
        ideal = fits[order] * pad_s.sum(axis=1).astype(np.float64)
        runs = [np.arange(s, e) for s, e in _ref_dp_segments(tokens, counts, ideal, pack_efficiency, cost.multiple)]
        runs += _ref_drain_carry(runs, tokens, ideal, pad_s, patch_s, cost, carry_limit)
    taken = np.zeros(len(order), dtype=bool)
    for r in runs:
        taken[r] = True
    runs.sort(key=lambda r: int(r[0]))
    return PoolPlan([order[r] for r in runs], order[~taken], oversize)


# --------------------------------------------------------------------------- workloads
def translation_lengths(n: int, seed: int) -> np.ndarray:
    """Short sentence pairs: log-normal mean 20, CV 0.6 (not clipped at 16 like the others)."""
    sigma2 = np.log1p(0.6 ** 2)
    x = np.random.default_rng(seed).lognormal(np.log(20.0) - sigma2 / 2, np.sqrt(sigma2), size=n)
    return np.clip(np.rint(x), 1, MAX_LEN).astype(np.int64)


def pareto_lengths(n: int, seed: int) -> np.ndarray:
    """A heavy tail: 16 x (1 + Lomax(1.2)), clipped to [16, 8192]; median about 28."""
    x = 16.0 * (1.0 + np.random.default_rng(seed).pareto(1.2, size=n))
    return np.clip(np.rint(x), 16, MAX_LEN).astype(np.int64)


WORKLOADS: Dict[str, Callable[[int, int], np.ndarray]] = {
    "translation": translation_lengths,
    "encdec": encoder_decoder_lengths,
    **{name: (lambda n, seed, mc=mc: lognormal_lengths(mc[0], mc[1], n, seed)) for name, mc in LOGNORMAL.items()},
    "pareto": pareto_lengths,
}

# variant -> CostModel keyword arguments; "patches" also draws a patch count per sample.
VARIANTS: Dict[str, dict] = {
    "plain": {},
    "multiple8": {"batch_size_multiple": 8},
    "pad8": {"pad_to_multiple_of": 8},
    "maxbatch256": {"max_batch_size": 256},
    "quadratic2048": {"quadratic_length": 2048},
    "patches": {"max_patches": 4096},
    "all": {"batch_size_multiple": 8, "pad_to_multiple_of": 8, "max_batch_size": 256, "quadratic_length": 2048,
            "max_patches": 4096},
}


def make_case(workload: str, variant: str, n: int, seed: int = 0) -> Tuple[np.ndarray, np.ndarray, CostModel,
                                                                          Optional[np.ndarray]]:
    lengths = WORKLOADS[workload](n, seed)
    kwargs = VARIANTS[variant]
    patches = None
    if "max_patches" in kwargs:
        # About a third of the samples carry an image; a batch of short ones hits the cap.
        rng = np.random.default_rng(seed + 7)
        patches = np.where(rng.random(n) < 0.3, rng.integers(1, 256, size=n), 0).astype(np.int64)
    ids = np.random.default_rng(seed + 3).permutation(n).astype(np.int64)
    return lengths, ids, CostModel((BUDGET,), **kwargs), patches


def time_us_per_sample(fn, lengths, ids, cost, patches, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(lengths, ids, cost, final=False, carry_limit=len(ids) // 2, patches=patches)
        times.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(times)) / len(ids)


def compare(case, a: PoolPlan, b: PoolPlan) -> str:
    """'yes': the same plan; 'tie': other runs of equal DP value (float noise broke the tie)."""
    if ([g.tolist() for g in a.groups] == [g.tolist() for g in b.groups]
            and a.carry.tolist() == b.carry.tolist() and a.oversize.tolist() == b.oversize.tolist()):
        return "yes"
    lengths, _, cost, patches = case
    rows = lengths.reshape(len(lengths), -1)
    padded = cost.pad(rows)
    ideal = cost.copies_that_fit(padded, patches) * padded.sum(axis=1)
    tokens = rows.sum(axis=1)

    def value(plan: PoolPlan) -> float:  # groups are in sorted order: g[0] is the longest
        return sum(float(tokens[g].sum()) / 0.95 - float(ideal[g[0]]) for g in plan.groups)

    same_shape = len(a.groups) == len(b.groups) and len(a.carry) == len(b.carry)
    return "tie" if same_shape and np.isclose(value(a), value(b), rtol=1e-12, atol=1e-6) else "NO"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000], help="pool sizes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", nargs="+", choices=sorted(WORKLOADS), help="these workloads only")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--no-before", action="store_true", help="skip the (slow) reference implementation")
    parser.add_argument("--profile", choices=sorted(WORKLOADS), help="cProfile plan_window on this workload")
    args = parser.parse_args()

    if args.profile:
        for variant in args.variants:
            case = make_case(args.profile, variant, max(args.sizes))
            prof = cProfile.Profile()
            prof.runcall(plan_window, *case[:3], final=False, carry_limit=len(case[0]) // 2, patches=case[3])
            print(f"== {args.profile} / {variant}, pool {len(case[0])}")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(12)
        return

    print(f"plan_window (final=False), microseconds per pooled sample, median of {args.repeats}; "
          f"token budget {BUDGET}")
    print(f"{'workload':<18} {'variant':<14} {'pool':>6} {'before':>9} {'after':>8} {'speedup':>8}  same plan")
    worst = 0.0
    for workload in args.only or list(WORKLOADS):
        for variant in args.variants:
            for n in args.sizes:
                case = make_case(workload, variant, n)
                after = time_us_per_sample(plan_window, *case, args.repeats)
                worst = max(worst, after)
                if args.no_before:
                    print(f"{workload:<18} {variant:<14} {n:>6} {'-':>9} {after:>8.2f}")
                    continue
                before = time_us_per_sample(reference_plan_window, *case, args.repeats)
                same = compare(case, plan_window(*case[:3], final=False, carry_limit=n // 2, patches=case[3]),
                               reference_plan_window(*case[:3], final=False, carry_limit=n // 2, patches=case[3]))
                print(f"{workload:<18} {variant:<14} {n:>6} {before:>9.2f} {after:>8.2f} {before / after:>7.1f}x  "
                      f"{same}", flush=True)
    print(f"slowest after: {worst:.2f} us per sample")


if __name__ == "__main__":
    main()
