"""Accelerate's ParallelismConfig and odb: tensor parallelism needs a loader planned over the mesh's replicas;
context and sequence parallelism are refused, naming why.

accelerate builds an Accelerator with a ParallelismConfig only under FSDP2, DeepSpeed or several GPUs (CPU
processes raise), so the Accelerator here is a stand-in holding a real ParallelismConfig and a process count;
the loaders are real (their ranks threads of this process, as a DeviceMesh's would be processes).
"""

from __future__ import annotations

import types

import pytest

# ParallelismConfig is new in accelerate 1.10; below it an Accelerator has no mesh for odb to read (make test-min).
ParallelismConfig = pytest.importorskip(
    "accelerate.parallelism_config", reason="accelerate < 1.10 has no ParallelismConfig").ParallelismConfig

import odb
from helpers import LengthDataset, known_lengths, pad_collate
from odb.comm.replicas import Replicas
from odb.comm.threads import ThreadRanks
from odb.integrations.accelerate import configure_accelerator

DATA = LengthDataset(known_lengths(32, 2, 20))


def accelerator(**sizes: int) -> types.SimpleNamespace:
    """What configure_accelerator reads of an Accelerator (one that accelerate builds only on GPUs here)."""
    return types.SimpleNamespace(parallelism_config=ParallelismConfig(**sizes), num_processes=4,
                                 gradient_accumulation_steps=1, device=None, device_placement=False,
                                 dispatch_batches=None, register_for_checkpointing=lambda obj: None)


def loader(exchange) -> odb.ODBDataLoader:
    replica, replicas = exchange.world()
    sampler = odb.ShardSampler(DATA, num_replicas=replicas, rank=replica)
    return odb.ODBDataLoader(DATA, token_budget=64, sampler=sampler, collate_fn=pad_collate, exchange=exchange)


def test_tensor_parallelism_takes_a_loader_planned_over_the_replicas():
    meshed = loader(ThreadRanks(4, replicas=Replicas.grid(2, 2)).exchanges(0))
    wrapped = configure_accelerator(accelerator(tp_size=2, dp_shard_size=2), meshed)
    assert wrapped.loader is meshed
    with pytest.raises(ValueError, match=r"plans over 4 ranks.*device_mesh=accelerator.torch_device_mesh"):
        configure_accelerator(accelerator(tp_size=2, dp_shard_size=2), loader(ThreadRanks(4).exchanges(0)))


@pytest.mark.parametrize("sizes", [{"cp_size": 2, "dp_shard_size": 2}, {"sp_size": 2, "sp_backend": "deepspeed"}])
def test_context_and_sequence_parallelism_are_refused_naming_why(sizes):
    kind = "context" if "cp_size" in sizes else "sequence"
    with pytest.raises(ValueError, match=rf"{kind} parallelism of size 2.*only under FSDP2.*device_mesh=mesh"):
        configure_accelerator(accelerator(**sizes), loader(ThreadRanks(4, replicas=Replicas.grid(2, 2)).exchanges(0)))
