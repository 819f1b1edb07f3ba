"""Time to first batch under DDP (2 gloo ranks, CPU): odb vs a plain DataLoader.

    python benchmarks/ddp_first_batch.py [--world 2] [--repeats 5]

Each rank builds both loaders over the same cheap dataset (tensor creation only) with
num_workers=2 and times iter() -> first batch, alternating the two, and prints the
medians and the difference (goal: odb <= plain + 0.3 s).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import odb
from odb.bench.workloads import lognormal_lengths


class Cheap(Dataset):
    def __init__(self, n: int = 20000) -> None:
        self.lengths = lognormal_lengths(900, 1.0, n, seed=0)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, 1000, (int(self.lengths[i]),))


def pad(samples):
    return torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)


def first_batch_s(loader) -> float:
    t = time.perf_counter()
    it = iter(loader)
    next(it)
    elapsed = time.perf_counter() - t
    del it
    return elapsed


def rank_main(rank: int, world: int, port: int, repeats: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ds = Cheap()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    plain = DataLoader(ds, batch_size=16, sampler=sampler, num_workers=2, collate_fn=pad)
    fast = odb.ODBDataLoader(ds, token_budget=16384, sampler=sampler, num_workers=2, collate_fn=pad, buffer_size=512)
    times = {"plain": [], "odb": []}
    for _ in range(repeats):
        for name, loader in (("plain", plain), ("odb", fast)):
            dist.barrier()
            times[name].append(first_batch_s(loader))
    out.put((rank, times))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.world, port, args.repeats, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, times in sorted(results.items()):
        mp_, mo = statistics.median(times["plain"]), statistics.median(times["odb"])
        print(f"rank {rank}: first batch plain {mp_:.3f} s, odb {mo:.3f} s, difference {mo - mp_:+.3f} s "
              f"(median of {args.repeats})")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
