"""Context parallelism: budgets per GPU, lengths padded to 2 x cp, and each CP rank's shard of a batch.

``context_shard`` gives CP rank i the chunks i and 2cp-1-i of every sequence (each sample of a packed row on its
own): the shards together hold every token once, each token keeps its position in its own sequence, and a packed
shard's ``cu_seq_lens`` bound its samples' parts. The loader plans a replica's micro-batch under cp x the per-GPU
``token_budget`` and pads every length to the multiple (padded rows by PadToBucket, packed samples by
PackedCollate(sample_multiple)).
"""

from __future__ import annotations

import pytest
import torch

import odb
from helpers import LengthDataset, known_lengths, pad_collate


def packed_row(sizes):
    ids = torch.arange(sum(sizes))[None] + 100
    positions = torch.cat([torch.arange(n) for n in sizes])[None]
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions, "use_cache": False}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_shards_hold_every_token_once_at_its_own_position(cp, packed):
    sizes = [8 * cp, 2 * cp, 4 * cp]
    batch = packed_row(sizes) if packed else {"input_ids": torch.arange(3 * 4 * cp).reshape(3, 4 * cp),
                                              "labels": torch.arange(3 * 4 * cp).reshape(3, 4 * cp)}
    full_pos = batch.get("position_ids", torch.arange(4 * cp).expand(3, 4 * cp))
    shards = [odb.context_shard(batch, r, cp) for r in range(cp)]
    ids = torch.cat([s["input_ids"] for s in shards], dim=1)
    assert sorted(ids.flatten().tolist()) == sorted(batch["input_ids"].flatten().tolist())
    for s in shards:  # a token's position is where it stood in its own sequence
        where = {int(t): int(p) for t, p in zip(batch["input_ids"].flatten(), full_pos.flatten())}
        assert [where[int(t)] for t in s["input_ids"].flatten()] == s["position_ids"].flatten().tolist()
        assert s["use_cache"] is False if packed else True
        assert torch.equal(s["labels"], s["input_ids"])
    if packed:
        assert shards[0]["cu_seq_lens_q"].tolist() == [0, 8, 10, 14]
        assert shards[0]["max_length_k"] == 8
    # load-balanced: every rank holds as many early as late tokens (the first chunk of rank 0 is the first one)
    assert shards[0]["position_ids"][0, 0] == 0 and shards[0]["position_ids"][0, -1] == (sizes[-1] if packed else
                                                                                           4 * cp) - 1


def test_a_sequence_that_does_not_split_evenly_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"\[6\] tokens do not split into 4 equal chunks.*sample_multiple=4"):
        odb.context_shard(packed_row([8, 6]), 0, 2)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_loader_plans_per_gpu_budgets_and_pads_to_2cp(layout):
    lengths = known_lengths(40, 3, 30, seed=2)
    options = {"collate_fn": pad_collate} if layout == "padded" else {}
    loader = odb.ODBDataLoader(LengthDataset(lengths), token_budget=48, layout=layout, context_parallel=2,
                               shift_labels=False, **options)
    seen = []
    for batch in loader:
        info = odb.pop_step_info(batch)
        seen += info.sample_ids
        width = batch["input_ids"].shape[1]
        assert width % 4 == 0
        assert batch["input_ids"].numel() <= 2 * 48  # a replica's micro-batch: cp x the per-GPU budget
        assert info.padded_tokens <= 2 * 48
        if layout == "packed":
            for size in torch.diff(torch.nonzero(batch["position_ids"][0] == 0).flatten(), append=torch.tensor(
                    [width])).tolist():
                assert size % 4 == 0
        for r in range(2):
            odb.context_shard(batch, r, 2)  # splits evenly
    assert sorted(seen) == list(range(40))


def test_a_packed_collate_that_does_not_pad_samples_is_refused():
    with pytest.raises(ValueError, match=r"sample_multiple=4"):
        odb.ODBDataLoader(LengthDataset([5, 6]), token_budget=48, layout="packed", context_parallel=2,
                          collate_fn=odb.PackedCollate())
