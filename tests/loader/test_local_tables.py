"""Known lengths: every rank computes each optimizer step's table, so the batch thread exchanges nothing per step.

With ``lengths=``, ``global_batch_size`` and a stride-sharded sampler, the steps planned across ranks come from
(sampler seed, epoch, world, lengths) alone (odb.epoch.local_table): the same micro-batches as online lengths,
whose tables are exchanged; one header per epoch checks the ranks agree; the training thread's exchange of each
step's supervised tokens (which also carries failures) is the only per-step collective.
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import pytest

import odb
from helpers import Counting, LengthDataset, known_lengths, on_threads, pad_collate
from odb.comm.threads import ThreadRanks
from odb.epoch.local_table import fast_global_order

LENGTHS = known_lengths(90, 1, 60, seed=5)


def run(rank: int, ex: Any, known: bool, sampler_kind: str) -> Dict[str, Any]:
    data = LengthDataset(LENGTHS)
    if sampler_kind == "shard":
        sampler = odb.ShardSampler(data, num_replicas=2, rank=rank, seed=3)
    else:
        import torch

        sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=rank, seed=3)
    counting = Counting(ex)
    loader = odb.ODBDataLoader(data, token_budget=150, global_batch_size=12, sampler=sampler, collate_fn=pad_collate,
                               shift_labels=False, exchange=counting, lengths=LENGTHS if known else None)
    epochs: List[Any] = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        epochs.append([(i.step, i.micro_step, i.sample_ids, i.global_loss_tokens, i.loss_scale)
                       for i in map(odb.pop_step_info, loader)])
    return {"epochs": epochs, "gathers": counting.counts}


@pytest.mark.parametrize("sampler_kind", ["shard", "distributed"])
def test_computed_tables_give_the_exchanged_plan_with_one_exchange_per_step(sampler_kind):
    known = on_threads(ThreadRanks(2), lambda r, ex: run(r, ex, True, sampler_kind))
    online = on_threads(ThreadRanks(2), lambda r, ex: run(r, ex, False, sampler_kind))
    for rank in range(2):
        assert not isinstance(known[rank], BaseException), known[rank]
        assert known[rank]["epochs"] == online[rank]["epochs"], f"rank {rank}: the computed plan is not the exchanged one"
        steps = [len({s[0] - s[1] for s in epoch}) for epoch in known[rank]["epochs"]]  # optimizer steps per epoch
        # each epoch: its run's exchange gathers once (the first header), its step exchange once per step
        assert known[rank]["gathers"] == [1, steps[0], 1, steps[1]], known[rank]["gathers"]
        assert sum(online[rank]["gathers"]) > 3 * sum(steps)  # (header, table and confirmations per step)


def test_the_fast_global_order_is_the_samplers():
    import torch

    data = list(range(23))
    for drop_last in (False, True):
        for world in (1, 3, 4, 30):
            samplers = [torch.utils.data.DistributedSampler(data, num_replicas=world, rank=r, seed=5, drop_last=drop_last)
                        for r in range(world)]
            order = fast_global_order(samplers[0], world, epoch=0)
            for r, sampler in enumerate(samplers):
                assert order[r::world].tolist() == list(sampler), (drop_last, world, r)


class Slow(Counting):
    """Every gather takes ``delay`` seconds more (a slow network)."""

    def __init__(self, inner: Any, delay: float) -> None:
        super().__init__(inner)
        self.delay = delay

    def __call__(self, timeout_s: float):
        import time

        ex = super().__call__(timeout_s)
        gather = ex.transport.gather

        def slow(message: np.ndarray, where: str) -> np.ndarray:
            time.sleep(self.delay)
            return gather(message, where)

        ex.transport.gather = slow
        return ex


def test_online_exchanges_run_ahead_of_a_training_step_that_outlasts_them():
    """Online lengths: the header, table, move and confirmations of the next step run on the batch thread while the
    loop trains; with 20 ms per gather and 60 ms per micro-batch of training, the loop waits far less than the
    gathers take."""
    import time

    def run(rank: int, ex: Any) -> Any:
        data = LengthDataset(LENGTHS)
        slow = Slow(ex, 0.02)
        loader = odb.ODBDataLoader(data, token_budget=150, global_batch_size=12, collate_fn=pad_collate,
                                   sampler=odb.ShardSampler(data, num_replicas=2, rank=rank, seed=3),
                                   shift_labels=False, exchange=slow)
        waits = []
        for batch in loader:
            waits.append(odb.pop_step_info(batch).loader_wait_s)
            time.sleep(0.06)
        return waits, sum(slow.counts)

    for waits, gathers in on_threads(ThreadRanks(2), run):
        steady = waits[len(waits) // 3:]  # past the first steps (the pipeline fills)
        assert gathers * 0.02 > 0.5  # the gathers took more than half a second in all
        assert sum(steady) < 0.25 * 0.02 * gathers, (sum(steady), gathers, waits)
