"""Each stateful unit of an epoch owns its state: constant keys, and a round trip continues alike."""

from typing import Any, List

import numpy as np

from odb.config import ODBConfig
from odb.data.source import SampleMeter, SampleSource
from odb.epoch.ranks import RankAligner
from odb.epoch.pool import SamplePool
from odb.epoch.run import EpochRun
from odb.epoch.run_state import RUN_KEYS, retained_positions
from odb.epoch.stats import EpochStats
from odb.plan.windows.window import WindowPlanner
from odb.step_info import pop_step_info

LENGTHS = [50, 50, 10, 10, 30, 70, 20, 20, 60, 5, 45, 15]


def test_window_planner_state_has_constant_keys_and_a_round_trip_plans_alike():
    cfg = ODBConfig(token_budget=100, buffer_size=8)
    lengths = np.array(LENGTHS)
    first = WindowPlanner(cfg)
    first.plan(np.arange(6), lengths[:6])
    state = first.state_dict()
    assert set(state) == {"counts", "carry"} and state["counts"][0] == 6
    resumed = WindowPlanner(cfg)
    carry = np.asarray(state["carry"], dtype=np.int64)
    resumed.load_state_dict(state, lengths[carry])
    a = first.plan(np.arange(6, 12), lengths[6:], final=True)
    b = resumed.plan(np.arange(6, 12), lengths[6:], final=True)
    assert [g.tolist() for g in a.groups] == [g.tolist() for g in b.groups]
    assert first.state_dict() == resumed.state_dict()


def test_window_planner_loads_states_saved_before_the_emitted_count():
    wp = WindowPlanner(ODBConfig(token_budget=100))
    wp.load_state_dict({"counts": [4, 90], "carry": []})
    assert wp.state_dict() == {"counts": [4, 90, 1], "carry": []}


def test_rank_aligner_state_has_constant_keys_and_a_single_process_stays_local():
    planner = WindowPlanner(ODBConfig(token_budget=100))
    aligner = RankAligner(None, planner, SamplePool(), epoch=0, seed=0, shuffle=False)
    assert aligner.state_dict() == {"all_done": False, "local_only": True}
    aligner.load_state_dict({"all_done": True, "local_only": False})
    assert aligner.state_dict() == {"all_done": True, "local_only": True}  # no exchange: local whatever was saved


def test_epoch_stats_load_in_place():
    stats = EpochStats()
    held = stats
    stats.load_state_dict(EpochStats(steps=5, split_groups=2).state_dict())
    assert held.steps == 5 and held.split_groups == 2


def _run(cfg: ODBConfig) -> EpochRun:
    cfg = cfg.replace(length_fn=lambda s: s, loss_tokens_fn=lambda s: s)
    meter = SampleMeter(cfg)
    records = [(i, i, n, meter(i, n)) for i, n in enumerate(LENGTHS)]
    source = SampleSource([records], cap_samples=cfg.buffer_size, cap_tokens=cfg.window_tokens, threaded=False)
    return EpochRun(cfg, source, list, epoch=0, seed=0, shuffle=False)


def _batches(run: Any) -> List[List[int]]:
    return [sorted(pop_step_info(b).sample_ids) for b, _ in run]


def test_epoch_run_state_has_the_saved_keys_and_resumes_the_same_batches():
    cfg = ODBConfig(token_budget=100, buffer_size=4, first_window_size=4, gradient_accumulation_steps=2)
    whole = _batches(_run(cfg))
    run = _run(cfg)
    it = iter(run)
    head = [sorted(pop_step_info(next(it)[0]).sample_ids)]
    state = run.state_dict()
    assert set(state) == RUN_KEYS
    position = state["position"]
    assert (position["micro_pos"], len(position["micro"])) == (1, 2)  # inside an optimizer step of 2 micro-batches
    resumed = _run(cfg)
    meter = SampleMeter(cfg.replace(length_fn=lambda s: s, loss_tokens_fn=lambda s: s))
    held = retained_positions(state)
    resumed.source.close()
    rest_records = [(i, i, n, meter(i, n)) for i, n in enumerate(LENGTHS) if i >= position["arrived"]]
    resumed.source = SampleSource([rest_records], cap_samples=cfg.buffer_size, cap_tokens=cfg.window_tokens,
                                  threaded=False)
    resumed.load_state_dict(state, {i: (i, LENGTHS[i], meter(i, LENGTHS[i])) for i in held})
    assert resumed.state_dict() == state
    # The emitted micro-batches of the step in progress are gone from both: compare what is left.
    assert head + _batches(resumed) == whole
