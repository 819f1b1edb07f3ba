"""token_budget="auto" through the loader: measured steps set the budget (issue 17).

A tiny embedding + linear model on CPU, measured by odb.train.memory.ActivationMeter: its
activations are 136 bytes per padded token (a float32 32-vector saved by the Linear, the int64
index saved by the Embedding), so the cap is a budget in disguise: ``CAP`` = 400 tokens' worth.
The step seconds come from a counting clock (one "second" per step) where a test needs
reproducible proposals (resume, ranks).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Dict, List, Optional

import pytest
import torch

import odb
from dist_harness import run_ranks as run_processes
from helpers import LengthDataset, known_lengths, pad_collate
from odb.comm.threads import ThreadRanks
from odb.epoch.auto import AutoControl
from odb.epoch.budget import AutoWindows
from odb.train.memory import ActivationMeter
from odb.train.oom import OOMCounters
from roundtrip import read, round_trip, step_record

BYTES_PER_TOKEN = 136
CAP = BYTES_PER_TOKEN * 400
LENGTHS = known_lengths(600, 1, 50, seed=1)


class Trainer:
    """One model, its meter and optimizer; ``step(batch, info)`` runs forward/backward (the meter sees the forward)."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
        self.meter = ActivationMeter(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.peaks: List[Optional[int]] = []

    def step(self, batch: Dict[str, Any], info: odb.ODBStepInfo) -> None:
        out = self.model(batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        odb.scale_loss(loss, info).backward()
        if info.is_last_micro_step:
            self.opt.step()
            self.opt.zero_grad()


def counting_clock() -> Any:
    ticks = itertools.count()
    return lambda: float(next(ticks))


def make_loader(trainer: Trainer, lengths: List[int] = LENGTHS, clock: bool = True, **options: Any
                ) -> odb.ODBDataLoader:
    options = {"token_budget": "auto", "memory_cap_bytes": CAP, "memory_meter": trainer.meter,
               "collate_fn": pad_collate, "shuffle": True, "seed": 0, "buffer_size": 64, "shift_labels": False,
               **options}
    loader = odb.ODBDataLoader(LengthDataset(lengths), **options)
    if clock:
        loader.odb_core.auto.clock = counting_clock()
    return loader


@pytest.mark.timeout(120)
def test_auto_budget_grows_from_its_start_and_keeps_every_step_under_the_cap():
    trainer = Trainer()
    loader = make_loader(trainer, clock=False)
    for batch in loader:
        trainer.step(batch, odb.pop_step_info(batch))
    stats = loader.odb_stats
    start = loader.odb_core.auto.start_budget
    assert start <= 2 * max(LENGTHS) and start % 2 == 0  # twice the first window's longest sample
    assert stats["auto_window_budget"] > start  # it grew from the start budget
    assert stats["auto_memory_coefficients_tokens"] == pytest.approx(BYTES_PER_TOKEN, rel=0.01)
    assert loader.odb_config.token_budget == "auto"
    for key in ("auto_effective_cap", "auto_memory_relative_error", "auto_time_relative_error", "auto_token_budget"):
        assert key in stats

    # A second epoch with every step measured: after the warm-up no step's peak is over the cap.
    peaks = []
    for batch in loader:
        info = odb.pop_step_info(batch)
        trainer.meter()
        trainer.step(batch, info)
        peaks.append(info.padded_tokens * BYTES_PER_TOKEN)
    assert max(peaks) <= CAP
    assert max(peaks) > CAP / 2  # and the budget is used


@pytest.mark.timeout(120)
def test_auto_budget_each_micro_batch_is_a_point_and_ghosts_are_not_fed():
    trainer = Trainer()
    loader = make_loader(trainer, gradient_accumulation_steps=2, auto_start_budget=60)
    steps = 0
    for batch in loader:
        info = odb.pop_step_info(batch)
        trainer.step(batch, info)
        steps += 1
    assert loader.odb_stats["auto_observed_steps"] == steps
    assert len(loader.odb_core.auto.budget.memory) == min(steps, 512)


@pytest.mark.timeout(120)
def test_worst_case_warm_up_measures_the_longest_shape_first():
    """probe_worst_case with "auto": the first step holds the first window's longest sample (the costliest
    shape per token is measured before the budget grows), and every step stays under the cap."""
    trainer = Trainer()
    loader = make_loader(trainer, clock=False, shuffle=False, probe_worst_case=True)
    widths, peaks = [], []
    for batch in loader:
        info = odb.pop_step_info(batch)
        trainer.step(batch, info)  # the loader reads the meter (a second reader here would take its peaks)
        widths.append(batch["input_ids"].shape[1])
        peaks.append(info.padded_tokens * BYTES_PER_TOKEN)
    first_window = LENGTHS[:loader.odb_config.first_window_size]
    assert widths[0] == max(first_window) > sorted(first_window)[len(first_window) // 2]
    assert max(peaks) <= CAP
    assert loader.odb_stats["auto_window_budget"] > loader.odb_core.auto.start_budget


@pytest.mark.timeout(120)
def test_auto_refuses_cpu_without_cap_or_meter_with_the_fix():
    if torch.cuda.is_available():
        pytest.skip("the refusals are for a process without CUDA")
    with pytest.raises(ValueError, match="memory_cap_bytes"):
        odb.ODBConfig(token_budget="auto", memory_meter=lambda: None)
    with pytest.raises(ValueError, match=r"ActivationMeter\(model\)"):
        odb.ODBConfig(token_budget="auto", memory_cap_bytes=10**9)
    with pytest.raises(ValueError, match="balance"):
        odb.ODBConfig(token_budget=64, balance="time")
    with pytest.raises(ValueError, match="sample_cost"):
        odb.ODBConfig(token_budget=64, sample_cost=-1.0)
    with pytest.raises(ValueError, match="shape_buckets"):
        odb.ODBConfig(token_budget="auto", memory_cap_bytes=10**9, memory_meter=lambda: None, shape_buckets=4)
    with pytest.raises(ValueError, match="lengths="):
        odb.ODBDataLoader(LengthDataset([3, 4]), token_budget="auto", memory_cap_bytes=10**9,
                          memory_meter=lambda: None, lengths=[3, 4], collate_fn=pad_collate)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("oversize", ["error", "skip"])
def test_a_sample_over_the_window_budget_that_fits_the_cap_trains_alone(oversize):
    """A start budget (or a fitted plan's budget) below a sample's length is odb's guess, not the user's
    rule: the sample trains alone (it raised 'no batch can hold it' before the model was even fitted,
    e.g. when ranks agreed on the smallest of their start budgets)."""
    trainer = Trainer()
    loader = make_loader(trainer, auto_start_budget=20, oversize=oversize)
    seen = []
    for batch in loader:
        info = odb.pop_step_info(batch)
        trainer.step(batch, info)
        seen.extend(info.sample_ids)
    assert sorted(seen) == list(range(len(LENGTHS)))  # nothing skipped: every sample fits the cap alone
    assert loader.odb_stats["oversize_alone"] >= sum(n > 20 for n in LENGTHS[:64])


@pytest.mark.timeout(120)
def test_auto_refuses_a_cap_too_small_for_the_longest_sample():
    trainer = Trainer()
    # 30 tokens' worth of cap: samples up to 50 tokens cannot fit once the memory model is fitted
    loader = make_loader(trainer, memory_cap_bytes=BYTES_PER_TOKEN * 30, auto_start_budget=60)
    with pytest.raises(ValueError, match="no batch can hold it"):
        for batch in loader:
            trainer.step(batch, odb.pop_step_info(batch))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ready", [0, 4])
def test_auto_resume_mid_epoch_gives_the_uninterrupted_batches(ready):
    trainer = Trainer()

    def record(batch: Dict[str, Any], info: odb.ODBStepInfo) -> Dict[str, Any]:
        trainer.step(batch, info)
        return dict(step_record(batch, info), padded=info.padded_tokens)

    def make() -> odb.ODBDataLoader:
        return make_loader(trainer, ready_batches=ready, gradient_accumulation_steps=2)

    reference = read(make(), record=record)
    for stop in (5, 23):
        got = round_trip(make, stop, record=record)
        assert got.state["budget"]["budget"] is not None and got.state["run"]["budget"] is not None
        assert got.epoch == reference, f"stop {stop}"
    assert max(r["padded"] for r in reference) > 2 * max(LENGTHS[:64])  # the budget moved within the epoch


@pytest.mark.timeout(120)
def test_old_states_without_auto_load_unchanged():
    loader = odb.ODBDataLoader(LengthDataset(LENGTHS), token_budget=200, collate_fn=pad_collate, seed=0,
                               shift_labels=False)
    state = loader.state_dict()
    assert "auto" not in state
    odb.ODBDataLoader(LengthDataset(LENGTHS), token_budget=200, collate_fn=pad_collate, seed=0,
                      shift_labels=False).load_state_dict(state)


@pytest.mark.timeout(120)
def test_packed_rows_under_auto_stay_under_the_cap():
    trainer = Trainer()
    loader = make_loader(trainer, clock=False, layout="packed", collate_fn=odb.PackedCollate())
    rows = []
    for _ in range(2):
        for batch in loader:
            info = odb.pop_step_info(batch)
            trainer.step(batch, info)
            rows.append(info.padded_tokens)
    assert loader.odb_stats["auto_window_budget"] > loader.odb_core.auto.start_budget
    assert max(rows[len(rows) // 2:]) * BYTES_PER_TOKEN <= CAP


@pytest.mark.timeout(120)
def test_sample_cost_is_a_plain_option_too():
    def sizes(**options: Any) -> List[int]:
        loader = odb.ODBDataLoader(LengthDataset([10] * 31 + [9] * 33), token_budget=200, collate_fn=pad_collate,
                                   seed=0, shift_labels=False, **options)
        return [odb.pop_step_info(b).local_samples for b in loader]

    assert max(sizes()) == 22  # 22 samples of 9
    assert max(sizes(sample_cost=10.0)) == 10  # each sample costs its length + 10


@pytest.mark.timeout(120)
def test_train_step_with_oom_fallback_tells_the_auto_budget():
    from odb.train.oom import train_step_with_oom_fallback

    trainer = Trainer()
    loader = make_loader(trainer, auto_start_budget=60)
    failed = []

    def loss_fn(batch: Dict[str, Any]) -> torch.Tensor:
        if not failed:  # the first pass runs out of memory
            failed.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        out = trainer.model(batch["input_ids"])
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    it = iter(loader)
    batch = next(it)
    info = odb.pop_step_info(batch)
    outcome = train_step_with_oom_fallback(loss_fn, batch, info, model=trainer.model,
                                           counters=loader.odb_oom_counters)
    assert outcome.local_ooms == 1
    next(it)
    assert loader.odb_stats["auto_ooms"] == 1 and loader.odb_stats["oom_errors"] == 1


@pytest.mark.timeout(120)
def test_oom_fallback_tells_the_auto_budget():
    trainer = Trainer()
    loader = make_loader(trainer, auto_start_budget=60)
    counters = loader.odb_oom_counters
    assert isinstance(counters, OOMCounters)
    it = iter(loader)
    batch = next(it)
    info = odb.pop_step_info(batch)
    trainer.step(batch, info)
    counters.on_oom()  # as odb.train.oom.train_step_with_oom_fallback does after an out-of-memory batch
    next(it)
    assert loader.odb_stats["auto_ooms"] == 1
    assert len(loader.odb_core.auto.budget.memory) == 0  # the batch that ran out of memory is no peak point


def _thread_rank(rank: int, ranks: ThreadRanks, plans: Dict[int, list], **options: Any) -> List[odb.ODBStepInfo]:
    trainer = Trainer(seed=rank)
    ds = LengthDataset(LENGTHS)
    loader = odb.ODBDataLoader(ds, sampler=odb.ShardSampler(ds, num_replicas=2, rank=rank, seed=3),
                               exchange=ranks.exchanges(rank), token_budget="auto", memory_cap_bytes=CAP,
                               memory_meter=trainer.meter, collate_fn=pad_collate, seed=0, buffer_size=64,
                               shift_labels=False, **options)
    loader.odb_core.auto.clock = counting_clock()
    infos = []
    for batch in loader:
        info = odb.pop_step_info(batch)
        trainer.step(batch, info)
        infos.append(info)
    plans[rank] = list(loader.odb_core.under_way.run.budget.plan_log)
    return infos


@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", [dict(auto_start_budget=60), dict(balance="time")])
def test_two_thread_ranks_plan_every_window_with_the_agreed_budget(monkeypatch, options):
    original = AutoWindows.next_window

    def logged(self: AutoWindows, **where: Any) -> Any:  # every window's plan, per rank
        costs = original(self, **where)
        self.__dict__.setdefault("plan_log", []).append((where["window_index"] + 1, self.plan, where["step"]))
        return costs

    monkeypatch.setattr(AutoWindows, "next_window", logged)
    timed = []
    original_time = AutoControl.time_cost

    def time_cost(self: AutoControl, mark: Any, lengths: Any, side: Any = None) -> Any:  # balance="time": seconds
        seconds = original_time(self, mark, lengths, side)
        timed.append(seconds is not None)
        return seconds

    monkeypatch.setattr(AutoControl, "time_cost", time_cost)
    ranks = ThreadRanks(2, timeout_s=60)
    plans: Dict[int, list] = {}
    results: List[Any] = [None, None]

    def run(rank: int) -> None:
        try:
            results[rank] = _thread_rank(rank, ranks, plans, **options)
        except BaseException as err:
            results[rank] = err

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    infos0, infos1 = results
    assert len(infos0) == len(infos1)
    first = 1 if "auto_start_budget" in options else 2  # without a start budget window 1 is each rank's own
    agreed = [[(w, p) for w, p, _ in plans[r] if w >= first] for r in range(2)]
    assert agreed[0] == agreed[1] and len(agreed[0]) > 3
    assert len({p.token_budget for _, p in agreed[0]}) > 1  # the budget moved
    if options.get("balance") == "time":  # the later windows paired their steps by the fitted time model,
        # and only windows where every rank's time model predicts asked it (before, a rank whose model was not
        # fitted yet paired by planner cost while another paired by seconds)
        assert timed and all(timed)
    else:
        assert not timed
    for rank, infos in enumerate(results):  # each step's batch is under its window's agreed budget
        windows = plans[rank]
        for info in infos:
            window = max((k for k, (_, _, made) in enumerate(windows) if made <= info.micro_batch), default=0)
            if windows[window][0] >= first and not info.is_ghost:
                assert info.padded_tokens <= max(p.token_budget for _, p, _ in windows[:window + 1])


def dist_auto(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """A rank of the gloo test: one epoch under token_budget="auto" with a fixed start budget."""
    trainer = Trainer(seed=rank)
    ds = LengthDataset(known_lengths(p["n"], 1, 50, seed=1))
    loader = odb.ODBDataLoader(ds, sampler=odb.ShardSampler(ds, num_replicas=world, rank=rank, seed=3),
                               token_budget="auto", memory_cap_bytes=CAP, memory_meter=trainer.meter,
                               auto_start_budget=60, collate_fn=pad_collate, seed=0, buffer_size=32,
                               shift_labels=False)
    steps, padded = 0, []
    for batch in loader:
        info = odb.pop_step_info(batch)
        trainer.step(batch, info)
        steps += 1
        padded.append(info.padded_tokens)
    stats = loader.odb_stats
    return {"steps": steps, "padded": padded, "budget": stats["auto_window_budget"]}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_two_gloo_processes_with_auto_budget(tmp_path):
    results = run_processes("test_auto_budget_loader:dist_auto", 2, {"n": 600}, tmp_path)
    assert results[0]["steps"] == results[1]["steps"]
    assert results[0]["budget"] > 60 and results[1]["budget"] > 60
    assert max(max(r["padded"]) for r in results) * BYTES_PER_TOKEN <= CAP
