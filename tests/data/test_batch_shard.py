"""odb.BatchShardSampler deals a global order to ranks as Accelerate deals a Trainer's batches.

Accelerate's own ``BatchSamplerShard`` (the piece ``accelerator.prepare`` wraps a DataLoader's batch sampler in)
is the reference: with ``drop_last`` and ``even_batches`` each way, every rank's indices are Accelerate's, in order
(repeats included), for sizes that end in an incomplete round, a partial batch, both, or neither, and for a dataset
smaller than one round.
"""

from __future__ import annotations

import pytest
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler

import odb


def accelerate_share(n: int, b: int, w: int, rank: int, drop_last: bool, even: bool) -> list:
    shard = BatchSamplerShard(BatchSampler(range(n), b, drop_last), num_processes=w, process_index=rank,
                              even_batches=even)
    return [i for batch in shard for i in batch]


@pytest.mark.parametrize("n,b,w", [(10, 2, 2), (23, 4, 3), (24, 4, 3), (7, 3, 1), (5, 4, 3), (37, 2, 4), (3, 2, 3)])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("even", [False, True])
def test_each_rank_gets_accelerates_batches(n, b, w, drop_last, even):
    shares = []
    for rank in range(w):
        ours = odb.BatchShardSampler(range(n), batch_size=b, num_replicas=w, rank=rank, drop_last=drop_last,
                                     even_batches=even)
        theirs = accelerate_share(n, b, w, rank, drop_last, even)
        assert list(ours) == theirs and len(ours) == len(theirs), (n, b, w, rank)
        shares.append(ours.share(rank))
    assert shares[0] == max(shares)  # rank 0's share counts the epoch's optimizer steps
