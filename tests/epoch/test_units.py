"""An epoch run is made of small units: each holds at most 15 attributes, and the run picks one window
strategy per epoch instead of branching on global_batch_size."""

from typing import Any, List

import pytest

from odb.config import ODBConfig
from odb.data.source import SampleMeter, SampleSource
from odb.epoch.run import EpochRun
from odb.epoch.windows import BudgetWindows, StepWindows
from odb.step_info import pop_step_info

LENGTHS = [50, 50, 10, 10, 30, 70, 20, 20, 60, 5, 45, 15]
MOST_ATTRIBUTES = 15


def _run(cfg: ODBConfig, **kw: Any) -> EpochRun:
    cfg = cfg.replace(length_fn=lambda s: s, loss_tokens_fn=lambda s: s)
    meter = SampleMeter(cfg)
    records = [(i, i, n, meter(i, n)) for i, n in enumerate(LENGTHS)]
    source = SampleSource([records], cap_samples=cfg.buffer_size, cap_tokens=cfg.window_tokens, threaded=False)
    return EpochRun(cfg, source, list, epoch=0, seed=0, shuffle=False, **kw)


def _steps(run: EpochRun) -> List[List[List[int]]]:
    """Each optimizer step's micro-batches, as sorted sample ids."""
    steps: List[List[List[int]]] = []
    for batch, _ in run:
        info = pop_step_info(batch)
        if info.micro_step == 0:
            steps.append([])
        steps[-1].append(sorted(info.sample_ids))
    return steps


def test_the_run_and_its_units_hold_few_attributes():
    run = _run(ODBConfig(token_budget=100, buffer_size=8))
    units = [run, run.aligner, run.windows, run.windows.groups, run.position, run.emission, run.batches,
             run.aligner.headers]
    for unit in units:
        assert len(vars(unit)) <= MOST_ATTRIBUTES, f"{type(unit).__name__}: {sorted(vars(unit))}"


@pytest.mark.parametrize("global_batch_size, strategy", [(None, BudgetWindows), (4, StepWindows)])
def test_the_run_picks_its_window_strategy(global_batch_size, strategy):
    cfg = ODBConfig(token_budget=100, buffer_size=8, global_batch_size=global_batch_size)
    assert type(_run(cfg).windows) is strategy


def test_step_windows_make_each_optimizer_step_of_its_samples_and_drop_last_keeps_whole_batches():
    cfg = ODBConfig(token_budget=100, buffer_size=8, global_batch_size=5)
    steps = _steps(_run(cfg))
    assert [sorted(i for micro in step for i in micro) for step in steps] == [
        list(range(0, 5)), list(range(5, 10)), [10, 11]]
    kept = _steps(_run(cfg, drop_last=True, batch_unit=1))  # the user's batches of 1: the last two kept
    assert kept == steps
    dropped = _steps(_run(cfg, drop_last=True))  # no batch of the user's known: the partial last step goes
    assert dropped == steps[:2]
