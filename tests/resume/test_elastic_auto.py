"""Elastic resume with token_budget="auto": a mid-epoch state of W ranks continues on W' ranks.

The rule (odb.resume.elastic, odb.epoch.auto.merged_state, odb.plan.auto.auto_budget.merge_states): every
new rank starts from the AutoBudget of the most conservative old rank (the least next proposal), with
every rank's out-of-memory knowledge; the frozen window plans of the interrupted epoch are dropped and the
re-partitioned epoch plans its remaining samples from that model, the new ranks agreeing through their
exchange. Checked here: no sample lost or repeated, equal steps on every new rank, every window planned
with one plan on all ranks, no step's measured peak over the cap, and the fitted model survives (the
budget after the resume is not the start budget again).

A tiny embedding + linear model on CPU measured by odb.train.memory.ActivationMeter (136 bytes of
activations per padded token); a rank's meter may read ``heavy`` times that (a rank that needs more
memory for the same batch). Ranks are threads (odb.comm.threads.ThreadRanks), and real gloo processes in
the ``dist`` test.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence

import pytest
import torch

import odb
from dist_harness import run_ranks as run_processes
from helpers import LengthDataset, known_lengths, pad_collate
from odb.comm.threads import ThreadRanks
from odb.epoch.budget import AutoWindows
from odb.plan.auto.auto_budget import AutoBudget, merge_states
from odb.plan.auto.step_model import shape_features
from odb.train.memory import ActivationMeter

BYTES_PER_TOKEN = 136
CAP = BYTES_PER_TOKEN * 400
START = 60
N = 400
STOP = 40  # steps before the checkpoint: the memory model is fitted and the agreed budget has moved


class Rank:
    """One rank's model and loader; ``peaks`` holds what its meter measured for each step."""

    def __init__(self, rank: int, world: int, exchanges: Any = None, heavy: float = 1.0, **options: Any) -> None:
        torch.manual_seed(rank)
        self.model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
        meter = ActivationMeter(self.model)
        self.peaks: List[Optional[float]] = []

        def measured() -> Optional[float]:  # the loader reads the meter once per step (and once as it hands out)
            bytes_ = meter()
            return None if bytes_ is None else bytes_ * heavy

        self.meter = measured
        ds = LengthDataset(known_lengths(N, 1, 50, seed=1))
        self.loader = odb.ODBDataLoader(
            ds, sampler=odb.ShardSampler(ds, num_replicas=world, rank=rank, seed=3), token_budget="auto",
            memory_cap_bytes=CAP, memory_meter=self.measure, auto_start_budget=START, collate_fn=pad_collate,
            seed=0, buffer_size=32, shift_labels=False, distributed=world > 1, exchange=exchanges, **options)
        ticks = itertools.count()  # one "second" per step: reproducible time models
        self.loader.odb_core.auto.clock = lambda: float(next(ticks))

    def measure(self) -> Optional[float]:
        value = self.meter()
        if value is not None:
            self.peaks.append(value)
        return value

    def run(self, stop: Optional[int]) -> Dict[str, Any]:
        """Train ``stop`` steps (None: to the epoch's end); the steps, the state, the peaks measured."""
        steps = []
        for batch in self.loader:
            info = odb.pop_step_info(batch)
            loss = torch.nn.functional.cross_entropy(self.model(batch["input_ids"]).flatten(0, 1),
                                                     batch["labels"].flatten(), ignore_index=-100)
            odb.scale_loss(loss, info).backward()
            steps.append({"step": info.micro_batch, "ids": list(info.sample_ids), "ghost": info.is_ghost,
                          "padded": info.padded_tokens})
            if stop is not None and len(steps) == stop:
                break
        state = json.loads(json.dumps(self.loader.state_dict()))  # the step in flight is measured here
        return {"steps": steps, "state": state, "peaks": list(self.peaks),
                "plans": list(getattr(self.loader.odb_core.under_way.run.budget, "plan_log", []))}


def thread_phase(world: int, states: Optional[List[Dict[str, Any]]], stop: Optional[int],
                 heavy: Sequence[float] = (), **options: Any) -> List[Dict[str, Any]]:
    """``world`` ranks as threads, each loading every old rank's ``states`` (if any), ``stop`` steps."""
    ranks = ThreadRanks(world, timeout_s=40) if world > 1 else None

    def go(r: int) -> Dict[str, Any]:
        rank = Rank(r, world, ranks.exchanges(r) if ranks else None, heavy=heavy[r] if r < len(heavy) else 1.0,
                    **options)
        loaded = None
        if states is not None:
            rank.loader.load_state_dict(states)
            loaded = rank.loader.odb_core.auto.budget.state_dict()
        return dict(rank.run(stop), loaded=loaded)

    with ThreadPoolExecutor(world) as pool:  # a rank that raises breaks the others' exchange (its timeout)
        futures = [pool.submit(go, r) for r in range(world)]
        return [f.result(timeout=60) for f in futures]


_NEXT_WINDOW = AutoWindows.next_window


def _logged_next_window(self: AutoWindows, **where: Any) -> Any:
    """AutoWindows.next_window that also logs every window's plan: ``plan_log`` of (window, budget, q, cost)."""
    costs = _NEXT_WINDOW(self, **where)
    self.__dict__.setdefault("plan_log", []).append(
        (where["window_index"] + 1, costs.token_budget, costs.quadratic_length, costs.sample_cost))
    return costs


@pytest.fixture
def plan_log(monkeypatch):
    monkeypatch.setattr(AutoWindows, "next_window", _logged_next_window)


def check_resumed(before: List[Dict[str, Any]], after: List[Dict[str, Any]], cap: float = CAP) -> None:
    """The elastic guarantees with "auto": coverage, equal steps, one plan per window, the cap, the fit kept."""
    got = Counter(i for r in before + after for s in r["steps"] for i in s["ids"] if not s["ghost"])
    assert got == Counter(range(N)), f"lost {Counter(range(N)) - got}, repeated {got - Counter(range(N))}"
    counts = {len(r["steps"]) for r in after}
    assert len(counts) == 1, f"step counts differ: {[len(r['steps']) for r in after]}"
    for k, column in enumerate(zip(*(r["steps"] for r in after))):
        assert {c["step"] for c in column} == {STOP + k}
    plans = [r["plans"] for r in after]
    assert all(p == plans[0] for p in plans) and len(plans[0]) > 1, "the new ranks planned a window differently"
    peaks = [p for r in after for p in r["peaks"]]
    assert peaks and max(peaks) <= cap, f"a step measured {max(peaks)} bytes over the cap {cap}"
    assert plans[0][0][1] > START  # the fitted model survived: not back at the start budget
    first = max(r["steps"][0]["padded"] for r in after)
    assert first > 2 * START, f"the first step after the resume holds {first} padded tokens"


# ---- thread ranks ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("old, new, options", [(2, 1, {}), (2, 3, {"balance": "time"}), (1, 2, {})],
                         ids=["2-to-1", "2-to-3-time-balance", "1-to-2"])
def test_auto_state_resumes_on_another_number_of_ranks(plan_log, old, new, options):
    before = thread_phase(old, None, STOP, **options)
    assert {s["step"] for r in before for s in r["steps"][-1:]} == {STOP - 1}
    after = thread_phase(new, [r["state"] for r in before], None, **options)
    check_resumed(before, after)
    merged = merge_states([r["state"]["budget"]["budget"] for r in before])
    for r in after:  # every new rank started from the merged AutoBudget (its first proposal made on loading)
        assert {k: r["loaded"][k] for k in ("memory", "time", "effective_cap")} == \
            {k: merged[k] for k in ("memory", "time", "effective_cap")}


@pytest.mark.timeout(60)
def test_the_most_conservative_ranks_model_is_the_start(plan_log):
    """Old rank 1 needs 1.5x the memory of rank 0 for a batch: the new ranks (all such ranks) start from
    rank 1's model, so no step goes over the cap. Rank 0's model alone (what a resume took before) planned
    steps that measured up to 1.3x the cap."""
    before = thread_phase(2, None, STOP, heavy=[1.0, 1.5])
    states = [r["state"] for r in before]
    merged = merge_states([s["budget"]["budget"] for s in states])
    assert merged["memory"] == states[1]["budget"]["budget"]["memory"]
    after = thread_phase(3, states, None, heavy=[1.5] * 3)
    check_resumed(before, after)


@pytest.mark.timeout(60)
def test_a_state_saved_between_epochs_starts_the_next_epoch_from_the_merged_model():
    before = thread_phase(2, None, None)
    rank = Rank(0, 1)
    rank.loader.load_state_dict([r["state"] for r in before])
    assert rank.loader.odb_core.auto.budget.memory.fitted
    first = next(iter(rank.loader))
    assert odb.pop_step_info(first).padded_tokens > 2 * START


# ---- the merge itself ----------------------------------------------------------------------------


def _fitted(bytes_per_token: float, start: int = 100) -> AutoBudget:
    budget = AutoBudget(1e6, start)
    for b, length in [(4, 100), (2, 300), (8, 50), (1, 600), (3, 200), (6, 120), (5, 70)]:
        f = shape_features([length] * b)
        budget.observe(f, peak=bytes_per_token * f[0] + 0.5 * f[1] + 1000.0 * f[2] + 2e5)
    return budget


@pytest.mark.timeout(60)
def test_merge_takes_the_least_proposal_with_every_ranks_ooms():
    light, heavy, unfitted = _fitted(100.0), _fitted(150.0), AutoBudget(1e6, 100)
    merged = merge_states([light.state_dict(), heavy.state_dict()])
    assert merged["memory"] == heavy.state_dict()["memory"]
    assert merge_states([unfitted.state_dict(), heavy.state_dict()])["memory"] == unfitted.state_dict()["memory"]
    one = light.state_dict()
    assert merge_states([one, json.loads(json.dumps(one))]) == one  # copies of one state: that state
    light.on_oom(shape_features([200] * 20))  # an OOM on the light rank lowers everyone's cap
    merged = merge_states([heavy.state_dict(), light.state_dict()])
    assert merged["effective_cap"] == light.effective_cap < 1e6 and merged["oom_pending"] and merged["ooms"] == 1
    loaded = AutoBudget(1e6, 1)
    loaded.load_state_dict(merged)
    assert loaded.propose().token_budget <= min(_copy_propose(light), _copy_propose(heavy))


def _copy_propose(budget: AutoBudget) -> int:
    copy = AutoBudget(1e6, 1)
    copy.load_state_dict(budget.state_dict())
    return copy.propose().token_budget


# ---- real gloo processes -------------------------------------------------------------------------


def gloo_phase(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """A rank of the dist test (gloo default group up): load every old state found, run, save."""
    from elastic_workers import read_states, save_state

    AutoWindows.next_window = _logged_next_window  # (a fresh process per rank and phase)
    odb_rank = Rank(rank, world, heavy=p["heavy"][rank])
    if p.get("load_from"):
        odb_rank.loader.load_state_dict(read_states(p["load_from"]))
    out = odb_rank.run(p.get("stop"))
    if p.get("save_to"):
        os.makedirs(p["save_to"], exist_ok=True)
        save_state(out["state"], p["save_to"], rank, "json")
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_two_gloo_ranks_resume_on_three(tmp_path):
    first = run_processes("test_elastic_auto:gloo_phase", 2, {"stop": STOP, "heavy": [1.0, 1.5],
                                                              "save_to": str(tmp_path / "a")}, tmp_path / "run1")
    second = run_processes("test_elastic_auto:gloo_phase", 3, {"heavy": [1.5] * 3, "load_from": str(tmp_path / "a")},
                           tmp_path / "run2")
    check_resumed(first, second)
