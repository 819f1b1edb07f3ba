"""Planner quality from lengths alone: fixed batching, transformers' samplers, odb, oracle.

Every method turns one length array into a list of batches (arrays of sample indices,
in emission order); ``batch_metrics`` scores them (definitions in docs/benchmarks.md).
For two length dimensions (encoder-decoder) the budget bounds the sum over dimensions:
a batch costs B x (max source + max target).

Two figures compare every method like with like: *token efficiency* (real / padded
tokens: how much of what a step computes is data) and *tokens per step against the
cap* (mean real tokens per micro-batch / budget: how much of the memory cap a step
uses; for a fixed batch size it is the same for every sampler, since they reorder the
same batches' worth of samples). The oracle (``oracle_batches``) knows every length and
is written here, independently of odb's planner: sort by decreasing padded length, cut
greedily under the budget.

The odb rows come from ``odb.ODBDataLoader`` itself: it iterates a dataset whose items
carry only their lengths (``num_workers=0``, a collate that returns nothing), and the
batches are read from each batch's ``ODBStepInfo``. The planner alone
(``odb.plan.windows.window.plan_stream`` over the same arrival order) is timed separately, and
whether it plans the same batches as the loader is recorded beside the figures.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

import odb
from odb import ODBConfig
from odb.plan.windows.window import plan_stream

from odb.bench.workloads import encoder_decoder_lengths, synthetic_workloads

BUFFER_SIZES = (512, 2048)  # odb-N: windows of exactly N samples
DEFAULT = "odb-default"  # odb at ODBConfig(token_budget=...) defaults
REBALANCE_GRAD_ACCUM = 8  # micro-batches per optimizer step given to BatchRebalanceSampler
SHORT_EPOCHS = (600, 2000)  # samples per epoch of the short-epoch table (the first windows' ramp-up)
SHORT_SEEDS = (0, 1, 2)  # seeded subsamples per short epoch

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
            from odb.bench.realdata import load_real_lengths
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
    """The planning figures of one plan (see docs/benchmarks.md).

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
        "tokens_per_step": real / len(batches),
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
def oracle_batches(lengths: np.ndarray, budget: int, pad_to_multiple_of: int = 1) -> List[np.ndarray]:
    """The offline oracle: every length known, sorted by decreasing padded length (summed over
    dimensions; ties by index), cut greedily: a batch takes the next sample while B x the sum
    over dimensions of the batch's longest padded length stays within ``budget``.

    Written apart from odb's planner so the benchmark does not measure odb against itself.
    A sample that alone exceeds the budget gets a batch of its own.

    Example:
        >>> [b.tolist() for b in oracle_batches(np.array([50, 30, 20, 45, 55]), 100)]
        [[4], [0, 3], [1, 2]]
    """
    x = np.asarray(lengths, dtype=np.int64).reshape(len(lengths), -1)
    m = int(pad_to_multiple_of)
    padded = -(-x // m) * m
    order = np.lexsort((np.arange(len(x)), -padded.sum(axis=1)))
    batches: List[np.ndarray] = []
    current: List[int] = []
    top = [0] * x.shape[1]
    for i, row in zip(order.tolist(), padded[order].tolist()):
        grown = [max(a, b) for a, b in zip(top, row)]
        if current and (len(current) + 1) * sum(grown) > budget:
            batches.append(np.asarray(current, dtype=np.int64))
            current, grown = [], row
        current.append(i)
        top = grown
    if current:
        batches.append(np.asarray(current, dtype=np.int64))
    return batches


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


class LengthsDataset:
    """Item i is ``{"lengths": ...}`` and nothing else; the order in which items are read is logged."""

    def __init__(self, lengths: np.ndarray) -> None:
        lengths = np.asarray(lengths, dtype=np.int64).reshape(len(lengths), -1)
        self.rows: List[Any] = (lengths[:, 0].tolist() if lengths.shape[1] == 1
                                else [tuple(r) for r in lengths.tolist()])
        self.read: List[int] = []

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        self.read.append(int(index))
        return {"lengths": self.rows[index]}


def sample_lengths(sample: Dict[str, Any]) -> Any:
    return sample["lengths"]


def empty_collate(samples: List[Any]) -> Dict[str, Any]:
    return {}


def odb_configs(budget: int, buffer_sizes: Sequence[int]) -> Dict[str, ODBConfig]:
    """odb-N: windows of exactly N samples; odb-default: every window option at its default."""
    fields = {f.name for f in dataclasses.fields(ODBConfig)}
    out: Dict[str, ODBConfig] = {}
    for size in buffer_sizes:
        extra: Dict[str, Any] = {"window_budgets": None} if "window_budgets" in fields else {}
        out[f"odb-{size}"] = ODBConfig(token_budget=budget, buffer_size=size, **extra)
    out[DEFAULT] = ODBConfig(token_budget=budget)
    return out


WINDOW_FIELDS = ("buffer_size", "window_budgets", "first_window_size", "max_carry", "pack_efficiency")


def window_settings(cfg: ODBConfig) -> Dict[str, Any]:
    """The window options of a config, as its fields say (only those the installed odb has)."""
    out = {k: getattr(cfg, k) for k in WINDOW_FIELDS if hasattr(cfg, k)}
    if hasattr(cfg, "emit_efficiency"):  # pack_efficiency=None: the layout's default
        out["pack_efficiency"] = cfg.emit_efficiency
        if cfg.pack_efficiency is None and cfg.layout == "padded":
            from odb.plan.windows.window import FEED_EFFICIENCY, FEED_SHARE
            out["ramp_up_rule"] = f"under {FEED_SHARE:.0%} of a window's new samples emitted: add runs >= {FEED_EFFICIENCY}"
    tokens = getattr(cfg, "window_tokens", None)
    if tokens is not None and not callable(tokens):
        out["window_tokens"] = tokens
    return out


def full_window_tokens(cfg: ODBConfig, lengths: np.ndarray) -> float:
    """Real tokens one full window holds on average: buffer_size samples, or fewer when token-sized."""
    totals = lengths.sum(axis=1)
    tokens = float(min(cfg.buffer_size, len(totals)) * totals.mean())
    limit = getattr(cfg, "window_tokens", None)
    if isinstance(limit, (int, float)):
        tokens = min(tokens, float(limit))
    return min(tokens, float(totals.sum()))


def odb_loader_run(lengths: np.ndarray, cfg: ODBConfig, seed: int, sequential: bool = False) -> Dict[str, Any]:
    """One epoch of ``odb.ODBDataLoader`` over a dataset of lengths; its batches and buffer figures.

    Default: ``shuffle=True`` (the loader's own seeded sampler), as users run it. With
    ``sequential``, the dataset is read in index order and batches are emitted in arrival
    order (``shuffle=False``): a sample's id is then its arrival position, as in
    ``plan_stream``, so the two can be compared batch for batch.

    Returns batches (dataset indices, emission order), arrival (each sample's position in
    the order the loader read the dataset), the loader's ``odb_stats`` and the peak
    samples and tokens read but not yet emitted after a batch left.
    """
    lengths = np.asarray(lengths, dtype=np.int64).reshape(len(lengths), -1)
    ds = LengthsDataset(lengths)
    loader = odb.ODBDataLoader(ds, config=cfg, shuffle=not sequential, seed=seed, collate_fn=empty_collate,
                               num_workers=0, length_fn=sample_lengths)
    batches: List[np.ndarray] = []
    read_at: List[int] = []
    t0 = time.perf_counter()
    for batch in loader:
        info = odb.pop_step_info(batch)
        batches.append(np.asarray(info.sample_ids, dtype=np.int64))
        read_at.append(len(ds.read))
    loader_s = time.perf_counter() - t0
    stats = dict(loader.odb_stats)
    read = np.asarray(ds.read, dtype=np.int64)
    arrival = np.full(len(lengths), -1, dtype=np.int64)
    arrival[read] = np.arange(len(read))
    totals = lengths.sum(axis=1)
    read_tokens = np.concatenate(([0], np.cumsum(totals[read])))
    sizes = np.array([len(b) for b in batches], dtype=np.int64)
    emitted_tokens = np.cumsum([int(totals[b].sum()) for b in batches]) if batches else np.zeros(0)
    at = np.asarray(read_at, dtype=np.int64)
    held_samples = at - np.cumsum(sizes) if batches else np.zeros(1)
    held_tokens = read_tokens[at] - emitted_tokens if batches else np.zeros(1)
    return {"batches": batches, "arrival": arrival, "read_order": read, "stats": stats, "loader_s": loader_s,
            "peak_held_samples": int(held_samples.max()), "peak_held_tokens": int(held_tokens.max())}


def time_planner(lengths: np.ndarray, cfg: ODBConfig,
                 cpu_times: Optional[List[float]] = None) -> Tuple[List[np.ndarray], List[float]]:
    """``odb.plan.windows.window.plan_stream`` over lengths in arrival order: its groups (arrival positions) and
    the seconds spent planning each window (wall clock); ``cpu_times``, when given, receives this
    thread's CPU seconds per window (what planning costs, whatever else shares the machine)."""
    groups: List[np.ndarray] = []
    times: List[float] = []
    windows = plan_stream(lengths, cfg)
    while True:
        t0, c0 = time.perf_counter(), time.thread_time()
        planned = next(windows, None)
        if planned is None:
            break
        times.append(time.perf_counter() - t0)
        if cpu_times is not None:
            cpu_times.append(time.thread_time() - c0)
        groups.extend(planned.groups)
    return groups, times


def reads_before_batches(lengths: np.ndarray, cfg: ODBConfig, ks: Sequence[int] = (1, 10)) -> Dict[str, Any]:
    """How many samples the loader must have read before its k-th batch can be planned (k in ``ks``),
    from ``plan_stream`` over lengths in arrival order: a measure of time to the first batches in
    samples read, free of thread timing. None where the epoch has fewer than k batches."""
    read, out, have = 0, {}, 0
    for window in plan_stream(lengths, cfg):
        read += window.new_samples
        have += len(window.groups)
        for k in ks:
            if have >= k and f"reads_before_batch_{k}" not in out:
                out[f"reads_before_batch_{k}"] = read
    return {f"reads_before_batch_{k}": out.get(f"reads_before_batch_{k}") for k in ks}


def _as_sets(batches: Sequence[np.ndarray]) -> List[Tuple[int, ...]]:
    return sorted(tuple(sorted(int(i) for i in b)) for b in batches)


def odb_method(lengths: np.ndarray, cfg: ODBConfig, budget: int, seed: int) -> Dict[str, Any]:
    """Figures of odb at ``cfg``: batches from the loader, planning time from plan_stream."""
    run = odb_loader_run(lengths, cfg, seed)
    m = batch_metrics(lengths, run["batches"], budget, run["arrival"])
    arrived = lengths[run["read_order"]]
    cpu: List[float] = []
    groups, times = time_planner(arrived, cfg, cpu)
    # The planner breaks ties between equal lengths by sample id (dataset index in the
    # loader, arrival position in plan_stream): compare on a loader run whose ids are
    # arrival positions.
    check = odb_loader_run(arrived, cfg, seed, sequential=True)
    n = len(lengths)
    stats = run["stats"]
    m.update(
        source="ODBDataLoader",
        plan_stream_same_batches=_as_sets(check["batches"]) == _as_sets(groups),
        window_plan_ms_mean=1e3 * float(np.mean(times)), window_plan_ms_max=1e3 * float(np.max(times)),
        windows=len(times), plan_s=float(np.sum(times)), plan_us_per_sample=1e6 * float(np.sum(times)) / max(n, 1),
        plan_cpu_us_per_sample=1e6 * float(np.sum(cpu)) / max(n, 1),
        loader_us_per_sample=1e6 * run["loader_s"] / max(n, 1),
        # how many full batches one window holds: small values force under-filled batches
        window_in_budgets=full_window_tokens(cfg, lengths) / budget,
        buffered_max=stats.get("buffered_max"), read_ahead_max=stats.get("read_ahead_max"),
        read_ahead_tokens_max=stats.get("read_ahead_tokens_max"), peak_held_samples=run["peak_held_samples"],
        peak_held_tokens=run["peak_held_tokens"], window_settings=window_settings(cfg),
        **reads_before_batches(arrived, cfg))
    return m


def _baselines(lengths: np.ndarray, budget: int, seed: int) -> Dict[str, Dict[str, Any]]:
    """Figures of the oracle and the fixed-size samplers on one length array."""
    b = fixed_batch_size(lengths, budget)
    t0 = time.perf_counter()
    methods = {"oracle": batch_metrics(lengths, oracle_batches(lengths, budget), budget)}
    methods["oracle"]["plan_s"] = time.perf_counter() - t0
    del methods["oracle"]["order_spearman"]  # the oracle emits sorted by length
    methods["fixed"] = batch_metrics(lengths, fixed_batches(lengths, b, seed), budget)
    if LengthGroupedSampler is not None:
        methods["length_grouped"] = batch_metrics(lengths, length_grouped_batches(lengths, b, seed), budget)
    if BatchRebalanceSampler is not None:
        t0 = time.perf_counter()
        methods["batch_rebalance"] = batch_metrics(lengths, rebalance_batches(lengths, b, seed), budget)
        methods["batch_rebalance"]["plan_s"] = time.perf_counter() - t0
    return methods


def _compare(methods: Dict[str, Dict[str, Any]]) -> None:
    """Each method against the oracle (useful fill, token efficiency) and LengthGroupedSampler."""
    oracle, grouped = methods["oracle"], methods.get("length_grouped")
    for m in methods.values():
        m["ratio_to_oracle"] = m["useful_fill"] / oracle["useful_fill"]
        m["token_efficiency_vs_oracle"] = m["token_efficiency"] / oracle["token_efficiency"]
        if grouped is not None:
            m["token_efficiency_minus_length_grouped"] = m["token_efficiency"] - grouped["token_efficiency"]


SHORT_KEYS = ("steps", "token_efficiency", "useful_fill", "ratio_to_oracle", "order_spearman",
              "token_efficiency_minus_length_grouped")


def short_epochs(lengths: np.ndarray, budget: int, sizes: Sequence[int] = SHORT_EPOCHS,
                 seeds: Sequence[int] = SHORT_SEEDS) -> Dict[str, Any]:
    """Epochs of ``sizes`` samples drawn from one workload (a seeded subsample per seed): the oracle,
    the fixed-size samplers and odb at its defaults (``ODBDataLoader``). Per size: the mean of each
    figure over the seeds, and the worst seed's odb-default token efficiency minus LengthGrouped's.

    An epoch this short never reaches full windows: it measures the first windows' ramp-up.
    """
    cfg = ODBConfig(token_budget=budget)
    out: Dict[str, Any] = {}
    for n in sizes:
        if n >= len(lengths):
            continue
        runs = []
        for seed in seeds:
            x = _subsample(lengths, n, seed)
            methods = _baselines(x, budget, seed)
            run = odb_loader_run(x, cfg, seed)
            methods[DEFAULT] = batch_metrics(x, run["batches"], budget)
            methods[DEFAULT].update(reads_before_batches(x[run["read_order"]], cfg))
            _compare(methods)
            runs.append(methods)
        mean = {k: {key: float(np.mean([r[k][key] for r in runs])) for key in SHORT_KEYS + ("tokens_per_step",)
                    if all(key in r[k] for r in runs)} for k in runs[0]}
        entry: Dict[str, Any] = {"samples": n, "seeds": list(seeds), "methods": mean,
                                 "fixed_batch_size": [fixed_batch_size(_subsample(lengths, n, s), budget)
                                                      for s in seeds]}
        entry["odb_reads_before_batch"] = {
            str(k): (None if any(r[DEFAULT][f"reads_before_batch_{k}"] is None for r in runs)
                     else float(np.mean([r[DEFAULT][f"reads_before_batch_{k}"] for r in runs]))) for k in (1, 10)}
        if "length_grouped" in runs[0]:
            entry["worst_token_efficiency_minus_length_grouped"] = float(
                min(r[DEFAULT]["token_efficiency_minus_length_grouped"] for r in runs))
        out[str(n)] = entry
    return out


def run_planning(workloads: Dict[str, np.ndarray], budget: int = 16384, buffer_sizes: Sequence[int] = BUFFER_SIZES,
                 seed: int = 0, progress: Callable[..., Any] = lambda it, **kw: it,
                 short_sizes: Sequence[int] = SHORT_EPOCHS) -> Dict[str, Any]:
    """Plan every workload with every method; figures per workload and method, and per short epoch."""
    configs = odb_configs(budget, buffer_sizes)
    result: Dict[str, Any] = {
        "token_budget": budget, "buffer_sizes": list(buffer_sizes), "seed": seed,
        "rebalance_grad_accum": REBALANCE_GRAD_ACCUM, "short_epoch_sizes": list(short_sizes),
        "oracle": "odb.bench.planning.oracle_batches (sort by decreasing length, cut greedily; not odb's planner)",
        "transformers_samplers": {"LengthGroupedSampler": LengthGroupedSampler is not None,
                                  "BatchRebalanceSampler": BatchRebalanceSampler is not None},
        "odb_default_window": window_settings(configs[DEFAULT]),
        "workloads": {},
    }
    for name in progress(list(workloads), desc="planning", unit="workload"):
        lengths = workloads[name]
        methods = _baselines(lengths, budget, seed)
        for key, cfg in configs.items():
            methods[key] = odb_method(lengths, cfg, budget, seed)
        _compare(methods)
        totals = lengths.sum(axis=1)
        result["workloads"][name] = {
            "samples": int(len(lengths)), "dims": int(lengths.shape[1]),
            "mean_length": [float(v) for v in lengths.mean(axis=0)],
            "max_length": [int(v) for v in lengths.max(axis=0)],
            "median_length": float(np.median(totals)), "p99_length": float(np.percentile(totals, 99)),
            "fixed_batch_size": fixed_batch_size(lengths, budget), "methods": methods,
            "short_epochs": short_epochs(lengths, budget, short_sizes),
        }
    return result
