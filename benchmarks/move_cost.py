"""What moving samples between ranks costs in a step planned across ranks (online lengths), against the step.

With ``global_batch_size`` and no ``lengths=``, odb plans each optimizer step across ranks and sends the
processed samples it planned for other ranks through ``RankExchange.move`` (pickled, one all_to_all of bytes
over the gloo group). This script trains the benchmark's CPU Llama (2 layers x 128 hidden, odb.bench.training_run)
with DDP on W real gloo processes over ShareGPT lengths (clipped to 1,024 tokens; each sample a dict of
``input_ids``, ``labels`` and ``attention_mask`` int64 tensors, as a tokenizing dataset returns it), one epoch
per arm, and prints per rank and step: samples and bytes sent, move milliseconds (pickle, exchange, unpickle:
``odb_stats["move_s"]``) and the step's wall milliseconds, for online lengths (samples move) and known lengths
(``lengths=``: a sample is its dataset index, nothing moves), each with the step planned across ranks (the
default) and with each rank planning its own share (``step_plan="rank"``). The move's share of the step says when it pays:
where it is a few percent and the global plan's step efficiency gain (make demo's scale section) is larger.

    python benchmarks/move_cost.py                  # 2 processes
    python benchmarks/move_cost.py --world 4 --samples 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Dict, List

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import odb
from odb.bench.scale import real_lengths
from odb.bench.text_data import VOCAB
from odb.bench.training_ddp import free_port
from odb.bench.training_run import build_model

BUDGET, PER_RANK = 4096, 16
# online / known lengths x the step planned across ranks (the default) / each rank's own share
ARMS = ("online-global", "known-global", "online-rank", "known-rank")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        ids = torch.randint(3, VOCAB, (int(self.lengths[i]),), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    width = max(len(s["input_ids"]) for s in samples)
    out = {k: torch.full((len(samples), width), -100 if k == "labels" else 0, dtype=torch.long) for k in samples[0]}
    for r, s in enumerate(samples):
        for k, v in s.items():
            out[k][r, :len(v)] = v
    return out


def rank_main(rank: int, world: int, port: int, samples: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    lengths = np.random.default_rng(0).choice(real_lengths("sharegpt"), size=samples)
    ds = Tokens(lengths)
    model = torch.nn.parallel.DistributedDataParallel(build_model(torch.device("cpu"), 1024, "sdpa"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    out: Dict[str, Any] = {}
    for arm in ARMS:
        lengths_of, plan = arm.split("-")
        loader = odb.ODBDataLoader(ds, token_budget=BUDGET, global_batch_size=PER_RANK * world, collate_fn=collate,
                                   sampler=torch.utils.data.DistributedSampler(ds, world, rank, seed=0),
                                   lengths=lengths.tolist() if lengths_of == "known" else None, shift_labels=True,
                                   step_plan=plan)
        step_ms, t0 = [], time.perf_counter()
        for batch in loader:
            info = odb.pop_step_info(batch)
            with model.no_sync() if not info.is_last_micro_step else torch.enable_grad():
                (model(**batch).loss * info.loss_scale).backward()
            if info.is_last_micro_step:
                opt.step()
                opt.zero_grad()
                step_ms.append(1e3 * (time.perf_counter() - t0))
                t0 = time.perf_counter()
        s = loader.odb_stats
        steps = len(step_ms)
        wait = s["wait_s"]
        out[arm] = {"steps": steps, "epoch_s": sum(step_ms) / 1e3, "wait_s": wait, "step_ms": statistics.median(step_ms), "moved_per_step": s["moved_samples"] / steps,
                    "kib_per_step": s["moved_bytes"] / 1024 / steps, "move_ms_per_step": 1e3 * s["move_s"] / steps}
    queue.put((rank, out))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--samples", type=int, default=384)
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, a.world, port, a.samples, queue)) for r in range(a.world)]
    for proc in procs:
        proc.start()
    got: Dict[int, Any] = {}
    while len(got) < len(procs):
        if any(proc.exitcode not in (None, 0) for proc in procs):
            raise SystemExit(f"a rank failed (exit codes {[proc.exitcode for proc in procs]}): its error is above")
        try:
            rank, out = queue.get(timeout=1.0)
            got[rank] = out
        except Exception:  # queue.Empty: keep waiting while the ranks run
            continue
    for proc in procs:
        proc.join()
    print(f"{a.world} gloo processes, {a.samples} ShareGPT samples, {PER_RANK} per rank per step, budget {BUDGET}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    print("rank  arm            steps  moved/step  KiB/step  move ms/step  step ms (median)  move share  epoch s  "
          "loader wait s")
    for rank in sorted(got):
        for arm, m in got[rank].items():
            print(f"{rank:>4}  {arm:<13}  {m['steps']:>5}  {m['moved_per_step']:>10.1f}  {m['kib_per_step']:>8.1f}  "
                  f"{m['move_ms_per_step']:>12.2f}  {m['step_ms']:>15.0f}  {m['move_ms_per_step'] / m['step_ms']:>10.3f}  "
                  f"{m['epoch_s']:>7.1f}  {m['wait_s']:>13.2f}")


if __name__ == "__main__":
    main()
