"""Packed (padding-free) batches: odb's online packing against what users pick instead.

Two parts, both with ``ODBConfig(layout="packed")`` (a batch is one padding-free row of
samples end to end, ``position_ids`` restarting at each sample):

Fill, on every planning workload (budget 16,384 tokens per row; two length dimensions,
source and target, count as one sequence of their sum):

- ``odb-packed``: the rows of ``ODBDataLoader(layout="packed")`` itself, every other
  option at its default;
- ``trl-bfd``: TRL's offline packing, ``trl.pack_dataset(dataset, seq_length=budget,
  strategy="bfd")`` over a ``datasets.Dataset`` holding the same lengths, as
  ``SFTTrainer(packing=True)`` calls it (it packs each ``datasets.map`` batch of 1,000
  samples on its own, and cuts samples longer than the row);
- ``fixed-count``: padding-free rows of a fixed number of samples B, the largest B whose
  worst case (B x the longest sample) fits the row, as ``DataLoader(batch_size=B,
  collate_fn=DataCollatorWithFlattening())`` gives.

useful fill = real tokens / (rows x budget). Goals: odb-packed >= 0.98 on every workload
and within 0.01 of trl-bfd.

Training speed with packed rows (odb's, TRL's) is measured by the training benchmark
(``odb.bench.training``), beside padded batches, on 1 process and 2 DDP ranks.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict

import numpy as np

from odb import ODBConfig

from odb.bench.planning import load_workloads, odb_loader_run, time_planner

FILL_MIN, VS_TRL_MAX_GAP = 0.98, 0.01


def _totals(lengths: np.ndarray) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    return lengths.reshape(len(lengths), -1).sum(axis=1)


def trl_bfd_rows(totals: np.ndarray, budget: int) -> Dict[str, Any]:
    """Rows and tokens of ``trl.pack_dataset(strategy="bfd")`` over samples of these lengths."""
    import datasets
    import pyarrow as pa
    from trl import pack_dataset

    offsets = np.concatenate(([0], np.cumsum(totals))).astype(np.int64)
    values = pa.array(np.zeros(int(offsets[-1]), dtype=np.int32))
    column = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    table = pa.table({"input_ids": column})
    ds = datasets.Dataset(datasets.table.InMemoryTable(table))
    datasets.disable_progress_bars()
    t0 = time.perf_counter()
    packed = pack_dataset(ds, seq_length=budget, strategy="bfd")
    seconds = time.perf_counter() - t0
    seq = packed.with_format("arrow")["seq_lengths"]
    kept = int(sum(int(x) for chunk in seq.to_pylist() for x in chunk))
    return {"rows": len(packed), "tokens": kept, "cut_tokens": int(totals.sum()) - kept, "seconds": seconds}


def packing_fill(workloads: Dict[str, np.ndarray], budget: int = 16384, seed: int = 0,
                 progress: Callable[..., Any] = lambda it, **kw: it) -> Dict[str, Any]:
    cfg = ODBConfig(token_budget=budget, layout="packed")
    out: Dict[str, Any] = {"token_budget": budget, "workloads": {}}
    for name in progress(list(workloads), desc="packing", unit="workload"):
        lengths = np.asarray(workloads[name], dtype=np.int64)
        totals = _totals(lengths)
        tokens = int(totals.sum())
        run = odb_loader_run(lengths, cfg, seed)
        rows = len(run["batches"])
        planned = sorted(int(i) for b in run["batches"] for i in b)
        _, times = time_planner(lengths[run["read_order"]], cfg)
        trl = trl_bfd_rows(totals, budget)
        b = max(1, budget // int(totals.max()))
        fixed_rows = math.ceil(len(totals) / b)
        w = {
            "samples": len(totals), "mean_length": float(totals.mean()), "tokens": tokens,
            "bound_rows": math.ceil(tokens / budget),
            "odb-packed": {"rows": rows, "fill": tokens / (rows * budget), "every_sample_once":
                           planned == list(range(len(totals))),
                           "plan_us_per_sample": 1e6 * float(np.sum(times)) / len(totals),
                           "peak_held_samples": run["peak_held_samples"]},
            "trl-bfd": {"rows": trl["rows"], "fill": trl["tokens"] / (trl["rows"] * budget),
                        "cut_tokens": trl["cut_tokens"], "pack_s": trl["seconds"]},
            "fixed-count": {"rows": fixed_rows, "fill": tokens / (fixed_rows * budget), "batch_size": b},
        }
        w["odb_minus_trl"] = w["odb-packed"]["fill"] - w["trl-bfd"]["fill"]
        out["workloads"][name] = w
    return out


def run_packing(n: int, *, real: bool = True, progress: Callable[..., Any] = lambda it, **kw: it) -> Dict[str, Any]:
    """Fill of odb's packed rows against TRL's and fixed-count rows (their training speed: odb.bench.training)."""
    workloads = load_workloads(n, real=real)
    return {"fill": packing_fill(workloads, progress=progress),
            "goals": {"fill_min": FILL_MIN, "vs_trl_max_gap": VS_TRL_MAX_GAP}}
