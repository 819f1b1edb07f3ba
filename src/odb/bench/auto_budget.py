"""``token_budget="auto"`` against the budgets a user could pick, every arm under one memory cap.

A section of ``make demo`` (``python -m odb.bench``: its ``auto_budget`` results and table), and on
its own, with more choices:

    .venv/bin/python benchmarks/auto_budget.py [--quick] [--repeats N] [--out out/auto_budget.json]

A tiny Llama (``LlamaConfig``, random weights, float32, CPU: hidden 64, 2 layers, 4 heads,
vocab 256) trains with AdamW for one epoch per arm on heavy-tailed length workloads
(``odb.bench.workloads``: a log-normal, mean 128 CV 1.0, and a Pareto ``16 x (1 + Lomax(1.2))``,
both truncated at 512 tokens; random token ids), once with attention ``eager`` (it saves
the B x heads x L^2 attention probabilities) and once with ``sdpa``.

Memory is what ``odb.train.memory.ActivationMeter(model)`` reports: the bytes autograd
saves for backward in the step's forward (parameters excluded). **Cap rule**: per workload
and attention kind, cap = ``CAP_FRACTION`` (0.5) x the memory of a batch of 8 copies of the
workload's longest sample, padded (the longest sample under a generous budget of
8 x max_len tokens).

Arms, all under that cap, all trained the same way (a fresh model from one seed, AdamW):

* ``oracle``: the largest fixed token budget for which no batch of the whole epoch exceeds
  the cap, found by bisection; each candidate's epoch is planned with
  ``odb.bench.planning.oracle_batches`` (every length known, sorted, cut greedily: written
  apart from odb's planner) and each batch's memory measured by the meter on a forward of
  that batch shape (cached by (B, L, padded or not)). The oracle trains those batches in a
  shuffled order. No user has it: it needs every length and a measurement of every shape.
* ``users_rule``: what a user does by trying the worst case: the largest B such that B copies
  of the longest sample fit the cap (measured), then ``token_budget = B x max_len``, planned
  by odb (``odb.plan.windows.window.plan_stream``, as ``ODBDataLoader(token_budget=...)`` plans).
* ``odb_at_oracle``: odb's planner at the oracle's budget (does odb's online plan at that
  budget stay under the cap?).
* ``auto``: odb's ``token_budget="auto"``: ``ODBDataLoader(..., token_budget="auto",
  memory_cap_bytes=cap, memory_meter=ActivationMeter(model))`` at its defaults (``--auto-mode manual``:
  ``odb.plan.auto.auto_budget.AutoBudget`` driven by this script between the windows odb's planner plans,
  propose -> plan the next window -> train, measure -> observe: the model without the loader's threads).

Reported per workload x attention: real and padded tokens per step (over the epoch, and real
after the first ``WARMUP`` = 50 steps), steps over the cap (in the first 50 steps and after
them), the largest step's memory / cap, real tokens/s end to end (planning, collate and the
training step; no DataLoader workers), and each arm's real tokens per step / the oracle's.
Goals: auto's real tokens/step after the 50 warm-up steps >= 0.9 x the oracle's; for eager,
the same ratio read as memory-planned / largest safe plain token budget (the oracle's budget
is that budget) >= 1.3; no auto step over the cap after the warm-up. Medians over
``--repeats`` with min-max. Budgets and memory are deterministic (the meter counts bytes);
only times vary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from odb.bench.planning import oracle_batches
from odb.bench.workloads import lognormal_lengths
from odb.config import ODBConfig
from odb.plan.costs.plan_costs import PlanCosts
from odb.plan.windows.window import WindowPlanner, plan_stream, window_cut, window_limits

MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, use_cache=False)
MAX_LEN = 512
CAP_FRACTION = 0.5
GENEROUS_B = 8  # the reference batch of the cap rule: 8 x the longest sample
WARMUP = 50
LR = 1e-3
ATTENTIONS = ("eager", "sdpa")
ARMS = ("oracle", "users_rule", "odb_at_oracle", "auto")
GOAL_ORACLE = 0.9
GOAL_EAGER_PLAIN = 1.3
AUTO_MARGIN = 0.1  # ODBConfig's auto_margin default: auto plans under (1 - AUTO_MARGIN) x the cap
SIZES = {"full": {"samples": 2000, "repeats": 3}, "quick": {"samples": 150, "repeats": 1}}


# ---- workloads ---------------------------------------------------------------------------------
def pareto_truncated(a: float, n: int, seed: int, max_len: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(16 * (1.0 + rng.pareto(a, size=n))), 16, max_len).astype(np.int64)


def workloads(n: int, max_len: int = MAX_LEN, seed: int = 0) -> Dict[str, Tuple[np.ndarray, str]]:
    """name -> (lengths in arrival order, description)."""
    return {
        "lognormal-cv1.0": (lognormal_lengths(128.0, 1.0, n, seed, max_len=max_len),
                            f"log-normal mean 128 CV 1.0, clipped to [16, {max_len}]"),
        "pareto-a1.2": (pareto_truncated(1.2, n, seed, max_len),
                        f"16 x (1 + Lomax(1.2)), clipped to [16, {max_len}]"),
    }


def token_ids(lengths: np.ndarray, seed: int = 0) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, MODEL["vocab_size"], (int(n),), generator=g) for n in lengths]


def collate(samples: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Right-pad; attention_mask marks real tokens; labels are -100 on padding."""
    ids = torch.nn.utils.rnn.pad_sequence(list(samples), batch_first=True, padding_value=0)
    lens = torch.tensor([len(s) for s in samples])
    mask = (torch.arange(ids.shape[1])[None, :] < lens[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


# ---- the model and its memory ------------------------------------------------------------------
def build_model(attn: str, max_len: int = MAX_LEN) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(max_position_embeddings=max_len, attn_implementation=attn, **MODEL)
    return LlamaForCausalLM(cfg).float()


def make_meter(model: torch.nn.Module) -> Callable[[], Optional[float]]:
    from odb.train.memory import ActivationMeter
    return ActivationMeter(model)


class ShapeMemory:
    """Memory (meter bytes) of a batch shape (B, L, padded or not), measured on a forward, cached.

    ``fits(b, length, padded, cap)`` answers from shapes already measured where it can: saved bytes
    grow with B, with L and with padding (sdpa saves the padding mask), so a shape no larger in any of
    them than one measured under the cap is under it, and one no smaller than one measured over it is
    over it (``dominance`` counts those answers); it measures only the shapes in between."""

    def __init__(self, model: torch.nn.Module, meter: Callable[[], Optional[float]]) -> None:
        self.model, self.meter = model, meter
        self.cache: Dict[Tuple[int, int, bool], float] = {}
        self.dominance = 0
        # per cap: the shapes measured under it and over it
        self._under: Dict[float, List[Tuple[int, int, bool]]] = {}
        self._over: Dict[float, List[Tuple[int, int, bool]]] = {}

    def fits(self, b: int, length: int, padded: bool, cap: float) -> bool:
        key = (int(b), int(length), bool(padded and b > 1 and length > 1))
        under, over = self._under.setdefault(cap, []), self._over.setdefault(cap, [])
        if key not in self.cache:
            if any(u[0] >= key[0] and u[1] >= key[1] and u[2] >= key[2] for u in under):
                self.dominance += 1
                return True
            if any(o[0] <= key[0] and o[1] <= key[1] and o[2] <= key[2] for o in over):
                self.dominance += 1
                return False
        ok = self(*key) <= cap
        (under if ok else over).append(key)
        return ok

    def group_fits(self, lengths: np.ndarray, cap: float) -> bool:
        lengths = np.asarray(lengths)
        return self.fits(len(lengths), int(lengths.max()), bool(lengths.min() != lengths.max()), cap)

    max_tokens: Optional[int] = None  # a shape of more padded tokens is not run: taken as over any cap

    def __call__(self, b: int, length: int, padded: bool) -> float:
        key = (int(b), int(length), bool(padded and b > 1 and length > 1))
        if self.max_tokens is not None and key[0] * key[1] > self.max_tokens:
            return math.inf
        if key not in self.cache:
            lens = [key[1]] + [key[1] - 1 if key[2] else key[1]] * (key[0] - 1)
            batch = collate([torch.ones(n, dtype=torch.long) for n in lens])
            self.meter()
            loss = self.model(**batch).loss
            del loss
            self.cache[key] = float(self.meter() or 0.0)
        return self.cache[key]

    def of_group(self, lengths: np.ndarray) -> float:
        lengths = np.asarray(lengths)
        return self(len(lengths), int(lengths.max()), bool(lengths.min() != lengths.max()))


def cap_for(mem: Callable[[int, int, bool], float], max_len: int) -> float:
    """The cap rule: CAP_FRACTION x the memory of GENEROUS_B padded copies of the longest sample."""
    return float(int(CAP_FRACTION * mem(GENEROUS_B, max_len, True)))


# ---- the budgets a user could pick, and the oracle ---------------------------------------------
def users_rule_budget(mem_one_shape: Callable[[int], float], max_len: int, cap: float, b_max: int = 4096) -> int:
    """token_budget = B x max_len for the largest B whose batch of B longest samples fits the cap
    (``mem_one_shape(B)``: the measured memory of B copies of the longest sample). At least 1 x max_len."""
    b = 1
    while b < b_max and mem_one_shape(b + 1) <= cap:
        b += 1
    return b * max_len


def epoch_fits(groups: Sequence[np.ndarray], lengths: np.ndarray, group_fits: Callable[[np.ndarray], bool]) -> bool:
    # The costliest batches first (most likely to exceed): a failing candidate stops early.
    order = sorted(range(len(groups)), key=lambda k: -len(groups[k]) * int(lengths[groups[k]].max()))
    return all(group_fits(lengths[groups[k]]) for k in order)


def oracle_budget(lengths: np.ndarray, mem_of_group: Optional[Callable[[np.ndarray], float]], cap: float,
                  plan: Callable[[np.ndarray, int], List[np.ndarray]] = oracle_batches,
                  step: int = 1, group_fits: Optional[Callable[[np.ndarray], bool]] = None) -> Tuple[int, int]:
    """(largest feasible budget found by bisection, candidates tried): a budget is feasible when no
    batch of ``plan(lengths, budget)`` exceeds ``cap`` (``mem_of_group(lengths) <= cap``, or
    ``group_fits(lengths)`` when given). The search starts at the longest sample (one sample per batch
    at the longest) and doubles to an infeasible budget, then bisects to ``step``. Raises if even the
    smallest budget exceeds the cap."""
    lengths = np.asarray(lengths, dtype=np.int64)
    tried = 0
    fits = group_fits if group_fits is not None else (lambda g: mem_of_group(g) <= cap)

    def feasible(budget: int) -> bool:
        nonlocal tried
        tried += 1
        return epoch_fits(plan(lengths, budget), lengths, fits)

    lo = int(lengths.max())
    if not feasible(lo):
        raise ValueError(f"a batch of the longest sample ({lo} tokens) alone exceeds the cap {cap:.0f}")
    hi = 2 * lo
    while feasible(hi):
        lo, hi = hi, 2 * hi
        if lo >= int(lengths.max()) * len(lengths):  # one batch holds the whole epoch: no larger budget differs
            return lo, tried
    while hi - lo > step:
        mid = (lo + hi) // 2
        if feasible(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried


# ---- training ------------------------------------------------------------------------------------
@dataclasses.dataclass
class EpochLog:
    real: List[int] = dataclasses.field(default_factory=list)
    padded: List[int] = dataclasses.field(default_factory=list)
    memory: List[float] = dataclasses.field(default_factory=list)
    budgets: List[float] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Dict[str, torch.Tensor]) -> None:
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run_groups(model: torch.nn.Module, meter: Callable[[], Optional[float]], samples: List[torch.Tensor],
               lengths: np.ndarray, groups_iter: Any, budget_of: Callable[[], float],
               observe: Optional[Callable[[np.ndarray, float, float], None]] = None) -> EpochLog:
    """Train one epoch over the groups ``groups_iter`` yields (planning time counts: it runs in the loop)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    log = EpochLog()
    meter()
    t0 = time.perf_counter()
    for g in groups_iter:
        g = np.asarray(g)
        batch = collate([samples[i] for i in g])
        ts = time.perf_counter()
        train_step(model, opt, batch)
        dt = time.perf_counter() - ts
        peak = float(meter() or 0.0)
        lens = lengths[g]
        log.real.append(int(lens.sum()))
        log.padded.append(int(len(g) * lens.max()))
        log.memory.append(peak)
        log.budgets.append(float(budget_of()))
        if observe is not None:
            observe(lens, peak, dt)
    log.seconds = time.perf_counter() - t0
    return log


def odb_groups(lengths: np.ndarray, budget: int) -> Any:
    for w in plan_stream(lengths, ODBConfig(token_budget=int(budget))):
        yield from w.groups
        yield from ([int(i)] for i in w.oversize)


class ManualAuto:
    """AutoBudget driven by hand between odb's windows (the loader's "auto" wiring, reproduced)."""

    def __init__(self, cap: float, start_budget: int) -> None:
        from odb.plan.auto.auto_budget import AutoBudget
        from odb.plan.auto.step_model import shape_features
        self.ab = AutoBudget(cap, start_budget)
        self.features = shape_features
        self.budget = float(start_budget)
        self.plans: List[Dict[str, Any]] = []

    def config(self) -> Tuple[ODBConfig, Any]:
        """The next window's config and its cost model (the plan's CostModel: budget, quadratic
        length, sample cost)."""
        plan = self.ab.propose()
        self.budget = plan.token_budget
        self.plans.append(dataclasses.asdict(plan))
        return ODBConfig(token_budget=int(plan.token_budget), quadratic_length=plan.quadratic_length,
                         sample_cost=plan.sample_cost), plan.cost_model()

    def groups(self, lengths: np.ndarray) -> Any:
        """plan_stream's loop, with the budget re-proposed before every window."""
        n = len(lengths)
        start, k = 0, 0
        wp: Optional[WindowPlanner] = None
        while start < n:
            cfg, cost = self.config()
            if wp is None:
                wp = WindowPlanner(cfg)
            else:
                wp.set_costs(PlanCosts.of(cfg))
            wp.cost = cost
            stop = start + window_cut(lengths[start:], *window_limits(cfg, k, n - start, len(wp.carried_ids)))
            w = wp.plan(np.arange(start, stop), lengths[start:stop], None, final=stop >= n)
            yield from w.groups
            yield from ([int(i)] for i in w.oversize)
            start, k = stop, k + 1

    def observe(self, lens: np.ndarray, peak: float, seconds: float) -> None:
        self.ab.observe(self.features(lens), peak=peak, seconds=seconds)


def start_budget(lengths: np.ndarray) -> int:
    """The loader's default start (auto_start_budget=None): twice the longest sample of the first window."""
    return 2 * int(lengths[:ODBConfig(token_budget=1).first_window_size].max())


def run_auto_loader(model: torch.nn.Module, meter: Callable[[], Optional[float]], samples: List[torch.Tensor],
                    lengths: np.ndarray, cap: float, seed: int) -> Tuple[EpochLog, Dict[str, Any]]:
    """token_budget="auto" through ODBDataLoader (the loader calls the meter; a wrapper records it)."""
    import odb
    seen: List[float] = []

    def recording() -> Optional[float]:
        v = meter()
        if v:
            seen.append(float(v))
        return v

    class _Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(samples)

        def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
            return {"input_ids": samples[i]}

    def coll(items: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        return collate([s["input_ids"] for s in items])

    loader = odb.ODBDataLoader(_Data(), token_budget="auto", memory_cap_bytes=int(cap), memory_meter=recording,
                               loss_tokens_fn=lambda s: len(s["input_ids"]) - 1, shift_labels=True, shuffle=False,
                               seed=seed, collate_fn=coll)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    log = EpochLog()
    t0 = time.perf_counter()
    for batch in loader:
        odb.pop_step_info(batch)
        m = batch["attention_mask"]
        log.real.append(int(m.sum()))
        log.padded.append(int(m.numel()))
        train_step(model, opt, batch)
    recording()  # the last step's forward
    log.seconds = time.perf_counter() - t0
    log.memory = seen
    stats = {k: v for k, v in loader.odb_stats.items() if k.startswith(("auto", "memory", "time", "effective", "cap",
                                                                           "last_plan", "ooms"))}
    return log, stats


# ---- one workload x attention ----------------------------------------------------------------------
def summarize(log: EpochLog, cap: float) -> Dict[str, Any]:
    mem = np.asarray(log.memory)
    over = mem > cap
    after = log.real[WARMUP:]
    return {"steps": len(log.real), "real_per_step": float(np.mean(log.real)),
            "real_per_step_after_warmup": float(np.mean(after)) if after else None,
            "padded_per_step": float(np.mean(log.padded)), "token_eff": float(np.sum(log.real) / np.sum(log.padded)),
            "over_cap_warmup": int(over[:WARMUP].sum()), "over_cap_after": int(over[WARMUP:].sum()),
            "max_mem_over_cap": float(mem.max() / cap) if len(mem) else None,
            "mem_p50_over_cap": float(np.median(mem) / cap) if len(mem) else None,
            "tokens_per_s": float(np.sum(log.real) / log.seconds), "seconds": log.seconds,
            "budget_first": log.budgets[0] if log.budgets else None,
            "budget_last": log.budgets[-1] if log.budgets else None}


def run_case(name: str, lengths: np.ndarray, attn: str, repeats: int, seed: int = 0,
             progress: Callable[[str], None] = print, mode: str = "loader") -> Dict[str, Any]:
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths))
    lengths = lengths[order]                        # arrival order of the epoch (one shuffle, every arm)
    samples = token_ids(lengths, seed)
    max_len = int(lengths.max())
    probe = build_model(attn, max_len)
    mem = ShapeMemory(probe, make_meter(probe))
    cap = cap_for(mem, max_len)
    # A shape of over 4 x the cap's reference batch's tokens is taken as over the cap without running it (the
    # reference batch itself costs 2 x the cap; short samples cost less per token, but not 8x less here):
    # each such forward would need gigabytes for a shape that cannot fit.
    mem.max_tokens = 4 * GENEROUS_B * max_len
    t0 = time.perf_counter()
    b_oracle, tried = oracle_budget(lengths, None, cap, group_fits=lambda g: mem.group_fits(g, cap))
    search_s = time.perf_counter() - t0
    b_user = users_rule_budget(lambda b: mem(b, max_len, False), max_len, cap)
    oracle_plan = oracle_batches(lengths, b_oracle)
    # The plain token budget under the memory auto may use ((1 - auto_margin) x the cap): memory planning
    # against token planning at equal memory (planning only: its tokens per step need no training).
    usable = (1.0 - AUTO_MARGIN) * cap
    b_margin, _ = oracle_budget(lengths, None, usable, group_fits=lambda g: mem.group_fits(g, usable))
    margin_plan = oracle_batches(lengths, b_margin)
    margin_per_step = float(lengths.sum() / len(margin_plan))
    progress(f"  {name} {attn}: cap {cap / 2**20:.1f} MiB; oracle budget {b_oracle} ({tried} candidates, "
             f"{len(mem.cache)} shapes measured, {mem.dominance} answered by dominance, {search_s:.1f} s); "
             f"users' rule {b_user}")
    runs: Dict[str, List[Dict[str, Any]]] = {a: [] for a in ARMS}
    auto_plans: List[Dict[str, Any]] = []
    auto_metrics: List[Dict[str, Any]] = []
    for r in range(repeats):
        for arm in ARMS:                            # arms interleaved within each repeat
            model = build_model(attn, max_len)
            meter = make_meter(model)
            if arm == "oracle":
                perm = np.random.default_rng(seed + 1 + r).permutation(len(oracle_plan))
                log = run_groups(model, meter, samples, lengths, (oracle_plan[k] for k in perm), lambda: b_oracle)
            elif arm in ("users_rule", "odb_at_oracle"):
                b = b_user if arm == "users_rule" else b_oracle
                log = run_groups(model, meter, samples, lengths, odb_groups(lengths, b), lambda b=b: b)
            elif mode == "loader":
                log, stats = run_auto_loader(model, meter, samples, lengths, cap, seed)
                auto_metrics.append(json.loads(json.dumps(stats, default=str)))
            else:
                auto = ManualAuto(cap, start_budget(lengths))
                log = run_groups(model, meter, samples, lengths, auto.groups(lengths), lambda: auto.budget,
                                 auto.observe)
                if r == 0:
                    auto_plans = auto.plans + [{"metrics": json.loads(json.dumps(auto.ab.metrics(), default=str))}]
            if hasattr(meter, "close"):
                meter.close()
            runs[arm].append(summarize(log, cap))
        progress(f"    repeat {r + 1}/{repeats}: " + ", ".join(
            f"{a} {runs[a][-1]['real_per_step']:.0f} tok/step {runs[a][-1]['tokens_per_s']:.0f} tok/s" for a in ARMS))
    return {"workload": name, "attention": attn, "samples": len(lengths), "max_len": max_len,
            "mean_len": float(lengths.mean()), "cap_bytes": cap, "oracle_budget": b_oracle,
            "oracle_candidates": tried, "oracle_shapes_measured": len(mem.cache),
            "oracle_shapes_by_dominance": mem.dominance, "oracle_search_s": search_s,
            "users_rule_budget": b_user, "oracle_at_margin_budget": b_margin,
            "oracle_at_margin_steps": len(margin_plan), "oracle_at_margin_real_per_step": margin_per_step,
            "auto_mode": mode, "auto_plans": auto_plans, "auto_metrics": auto_metrics, "runs": runs}


# ---- report ------------------------------------------------------------------------------------------
def med(values: Sequence[float]) -> Tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def spread(values: Sequence[float], fmt: str = "{:.0f}") -> str:
    m, lo, hi = med(values)
    return fmt.format(m) if lo == hi else f"{fmt.format(m)} ({fmt.format(lo)}-{fmt.format(hi)})"


def after_ratio(runs: Dict[str, List[Dict[str, Any]]], arm: str) -> List[float]:
    """The arm's real tokens/step after the warm-up / the oracle's over its whole epoch, per repeat."""
    return [a["real_per_step_after_warmup"] / o["real_per_step"] for a, o in zip(runs[arm], runs["oracle"])
            if a["real_per_step_after_warmup"] is not None]


def goals(case: Dict[str, Any]) -> Dict[str, Any]:
    runs = case["runs"]
    ratio = after_ratio(runs, "auto")
    whole = [a["real_per_step"] / o["real_per_step"] for a, o in zip(runs["auto"], runs["oracle"])]
    r = med(ratio)[0] if ratio else None  # None: the epoch is shorter than the warm-up
    out = {"auto_over_oracle": r, "auto_over_oracle_whole_epoch": med(whole)[0],
           "auto_over_oracle_met": r is not None and r >= GOAL_ORACLE,
           "auto_over_cap_after_warmup": max(r["over_cap_after"] for r in runs["auto"]),
           "auto_no_over_cap_after_warmup_met": max(r["over_cap_after"] for r in runs["auto"]) == 0}
    plain = [a["real_per_step_after_warmup"] / case["oracle_at_margin_real_per_step"] for a in runs["auto"]
             if a["real_per_step_after_warmup"] is not None]
    out["memory_planned_over_plain"] = med(plain)[0] if plain else None
    if case["attention"] == "eager":
        out["memory_planned_over_plain_met"] = bool(plain) and med(plain)[0] >= GOAL_EAGER_PLAIN
    return out


def after_cell(rs: List[Dict[str, Any]]) -> str:
    vals = [r["real_per_step_after_warmup"] for r in rs if r["real_per_step_after_warmup"] is not None]
    return spread(vals) if vals else "-"


def fmt_ratio(x: Optional[float]) -> str:
    return "n/a (epoch shorter than the warm-up)" if x is None else f"{x:.2f}"


def table(cases: List[Dict[str, Any]]) -> str:
    head = ("| workload | attention | cap MiB | arm | budget | steps | real tok/step | padded tok/step | "
            "after warm-up | over cap: warm-up / after | max mem / cap | real tokens/s | / oracle tok/step | "
            "after warm-up / oracle |")
    lines = [head, "|" + "---|" * 14]
    for c in cases:
        runs = c["runs"]
        for arm in ARMS:
            rs = runs[arm]
            if arm == "oracle":
                budget = str(c["oracle_budget"])
            elif arm == "users_rule":
                budget = str(c["users_rule_budget"])
            elif arm == "odb_at_oracle":
                budget = str(c["oracle_budget"])
            else:
                budget = f"auto ({c['auto_mode']})"
                if rs[0]["budget_first"] is not None:
                    budget += f": {rs[0]['budget_first']:.0f} -> {rs[0]['budget_last']:.0f}"
            ratio = [r["real_per_step"] / o["real_per_step"] for r, o in zip(rs, runs["oracle"])]
            lines.append(
                f"| {c['workload']} | {c['attention']} | {c['cap_bytes'] / 2**20:.1f} | {arm} | {budget} | "
                f"{spread([r['steps'] for r in rs])} | {spread([r['real_per_step'] for r in rs])} | "
                f"{spread([r['padded_per_step'] for r in rs])} | "
                f"{after_cell(rs)} | "
                f"{max(r['over_cap_warmup'] for r in rs)} / {max(r['over_cap_after'] for r in rs)} | "
                f"{max(r['max_mem_over_cap'] for r in rs):.3f} | {spread([r['tokens_per_s'] for r in rs])} | "
                f"{spread(ratio, '{:.2f}')} | {spread(after_ratio(runs, arm), '{:.2f}') if after_ratio(runs, arm) else '-'} |")
            if arm == "oracle":  # planning only: its tokens per step need no training
                mps = c["oracle_at_margin_real_per_step"]
                lines.append(
                    f"| {c['workload']} | {c['attention']} | {c['cap_bytes'] / 2**20:.1f} | oracle_at_margin "
                    f"(under {1 - AUTO_MARGIN:g} x cap; planned, not trained) | {c['oracle_at_margin_budget']} | "
                    f"{c['oracle_at_margin_steps']} | {mps:.0f} | - | - | 0 / 0 | <= {1 - AUTO_MARGIN:g} | - | "
                    f"{mps / med([o['real_per_step'] for o in runs['oracle']])[0]:.2f} | - |")
    return "\n".join(lines)


def goal_lines(cases: List[Dict[str, Any]]) -> List[str]:
    out = []
    for c in cases:
        g = goals(c)
        s = (f"{c['workload']} {c['attention']}: auto's real tokens/step after {WARMUP} warm-up steps / "
             f"the oracle's {fmt_ratio(g['auto_over_oracle'])} (whole epoch {g['auto_over_oracle_whole_epoch']:.2f}) "
             f"(goal >= {GOAL_ORACLE}: {'met' if g['auto_over_oracle_met'] else 'NOT MET'}); "
             f"auto steps over the cap after {WARMUP} warm-up steps: {g['auto_over_cap_after_warmup']} "
             f"(goal 0: {'met' if g['auto_no_over_cap_after_warmup_met'] else 'NOT MET'})")
        if "memory_planned_over_plain_met" in g:
            s += (f"; memory-planned (auto, after warm-up) / the largest safe plain budget under the same usable "
                  f"memory ({1 - AUTO_MARGIN:g} x the cap: oracle_at_margin) {fmt_ratio(g['memory_planned_over_plain'])} "
                  f"(goal >= {GOAL_EAGER_PLAIN}: {'met' if g['memory_planned_over_plain_met'] else 'NOT MET'})")
        out.append(s)
    return out


def run_auto_budget(quick: bool = False, samples: Optional[int] = None, repeats: Optional[int] = None,
                    max_len: int = MAX_LEN, workload_names: Optional[Sequence[str]] = None,
                    attentions: Sequence[str] = ATTENTIONS, auto_mode: str = "loader",
                    progress: Callable[[str], None] = print, command: str = "python -m odb.bench") -> Dict[str, Any]:
    """Every workload x attention kind (``SIZES`` by ``quick``); the results ``make demo`` stores under
    ``auto_budget`` (cases, goals, settings)."""
    size = SIZES["quick" if quick else "full"]
    n = samples or size["samples"]
    repeats = repeats or size["repeats"]
    wl = workloads(n, max_len)
    if workload_names:
        wl = {k: wl[k] for k in workload_names}
    t0 = time.perf_counter()
    mode = "ODBDataLoader(token_budget='auto', memory_cap_bytes=cap, memory_meter=ActivationMeter(model))" \
        if auto_mode == "loader" else "AutoBudget driven by this script between odb's windows"
    progress(f"auto budget benchmark: {n} samples per workload, {repeats} repeat(s), {torch.get_num_threads()} "
             f"torch threads; auto arm: {mode}")
    cases = []
    for name, (lengths, _) in wl.items():
        for attn in attentions:
            cases.append(run_case(name, lengths, attn, repeats, mode=auto_mode, progress=progress))
    return {"command": command, "quick": bool(quick), "samples": n, "repeats": repeats, "max_len": max_len,
            "cap_rule": f"{CAP_FRACTION} x memory of {GENEROUS_B} padded copies of the longest sample",
            "warmup_steps": WARMUP, "auto_margin": AUTO_MARGIN, "model": MODEL, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "auto_mode": mode, "workloads": {k: d for k, (_, d) in wl.items()},
            "cases": cases, "goals": [goals(c) for c in cases], "seconds": time.perf_counter() - t0}


def goal_rows(result: Dict[str, Any]) -> List[Tuple[str, str, str, Optional[bool]]]:
    """(goal, measured, target, met) of every case, for the benchmark's goals table."""
    out: List[Tuple[str, str, str, Optional[bool]]] = []
    for c in result["cases"]:
        g = goals(c)
        what = f"auto budget {c['workload']} {c['attention']}"
        r = g["auto_over_oracle"]
        out.append((f"{what}: real tokens/step after {WARMUP} steps / oracle budget's", fmt_ratio(r),
                    f">= {GOAL_ORACLE}", None if r is None else g["auto_over_oracle_met"]))
        out.append((f"{what}: steps over the cap after {WARMUP} steps", str(g["auto_over_cap_after_warmup"]), "0",
                    g["auto_no_over_cap_after_warmup_met"]))
        if "memory_planned_over_plain_met" in g:
            p = g["memory_planned_over_plain"]
            out.append((f"{what}: memory-planned / largest safe plain budget, both under {1 - AUTO_MARGIN:g} x cap",
                        fmt_ratio(p), f">= {GOAL_EAGER_PLAIN}", None if p is None else g["memory_planned_over_plain_met"]))
    return out


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few hundred samples, 1 repeat (not meaningful)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--samples", type=int, default=None, help="samples per workload (default: 2000, quick 150)")
    ap.add_argument("--max-len", type=int, default=MAX_LEN)
    ap.add_argument("--workloads", default=None, help="comma-separated subset")
    ap.add_argument("--attention", default=",".join(ATTENTIONS))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--auto-mode", default="loader", choices=["loader", "manual"],
                    help="auto arm through ODBDataLoader (loader, the default), or AutoBudget driven by this "
                         "script between odb's windows (manual: the model without the loader's threads)")
    ap.add_argument("--out", default="out/auto_budget.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = " ".join([os.path.basename(sys.executable), "benchmarks/auto_budget.py"]
                       + list(argv if argv is not None else sys.argv[1:]))
    result = run_auto_budget(args.quick, args.samples, args.repeats, args.max_len,
                             args.workloads.split(",") if args.workloads else None, args.attention.split(","),
                             args.auto_mode, command=command)
    print()
    print(table(result["cases"]))
    print()
    for line in goal_lines(result["cases"]):
        print("- " + line)
    print(f"\n{result['seconds']:.0f} s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=float)
    return result


if __name__ == "__main__":
    main()
