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

Training (CPU, the tiny Llama of the training benchmark, budget 4,096, the same samples
for every arm, arms interleaved step by step): ``odb-padded`` (the padded layout, as in
the training benchmark, ``sdpa``), ``odb-packed``, ``fixed-count`` and ``trl-bfd`` (the
packed rows of ``trl.pack_dataset``, one row per step, TRL's own padding-free collator),
the packed arms with ``attn_implementation="odb_varlen"`` (causal attention per sample:
what flash-attention's varlen kernel does on CUDA), and ``odb-packed-sdpa``: odb's packed
rows with ``sdpa``, whose dense block-diagonal mask costs a row's attention as one sample
of the row's length. Real tokens per second of wall time, data loading included. Goal:
odb-packed >= odb-padded.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import odb
from odb import ODBConfig

from .planning import load_workloads, odb_loader_run, time_planner
from .training import VOCAB, Arm, _warm_up, run_arms, training_lengths

FILL_MIN, VS_TRL_MAX_GAP = 0.98, 0.01
PACKED_ATTN = "odb_varlen"  # the packed arms' attention: per-sample causal attention (odb.varlen_attention)


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


# ---- training -------------------------------------------------------------------------------------
class TokenRows(Dataset):
    """Rows of ``trl.pack_dataset``: ``{"input_ids": [...], "seq_lengths": [...]}``."""

    def __init__(self, rows: Any) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return self.rows[i]


class FixedTokens(Dataset):
    """Sample i: fixed random tokens of lengths[i] (the same tokens for every arm)."""

    def __init__(self, lengths: Sequence[int], seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = [torch.randint(1, VOCAB, (int(n),), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


def _pad_collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    from .loader_speed import pad_collate
    return pad_collate(samples)


def _flatten_collate() -> Callable[[List[Dict[str, Any]]], Dict[str, Any]]:
    from transformers import DataCollatorWithFlattening

    flat = DataCollatorWithFlattening(return_tensors="pt")
    return lambda samples: flat([{"input_ids": s["input_ids"].tolist()} for s in samples])


def _trl_loader(dataset: FixedTokens, budget: int, seed: int) -> DataLoader:
    import datasets
    from trl import pack_dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"input_ids": [t.tolist() for t in dataset.ids]})
    rows = pack_dataset(ds, seq_length=budget, strategy="bfd")
    collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    return DataLoader(TokenRows(rows), batch_size=1, shuffle=True, collate_fn=collate,
                      generator=torch.Generator().manual_seed(seed))


def packing_training(samples: int, *, budget: int = 4096, max_len: int = 1024, device: str = "cpu",
                     threads: Optional[int] = None,
                     progress: Callable[..., Any] = lambda it, **kw: it) -> Dict[str, Any]:
    """Every packed arm and odb's padded layout on the same samples and model; real tokens/s."""
    dev = torch.device(device)
    if threads is not None and dev.type == "cpu":
        torch.set_num_threads(threads)
    lengths = training_lengths(samples, max_len)
    dataset = FixedTokens(lengths)
    fixed_b = max(1, budget // int(lengths.max()))
    _warm_up(dev, max_len)
    _warm_up(dev, max_len, PACKED_ATTN)
    packed = {"layout": "packed", "token_budget": budget, "shuffle": True, "seed": 0}
    loaders: Dict[str, DataLoader] = {
        "odb-padded": odb.ODBDataLoader(dataset, token_budget=budget, shuffle=True, seed=0, collate_fn=_pad_collate),
        "odb-packed": odb.ODBDataLoader(dataset, **packed),
        "odb-packed-sdpa": odb.ODBDataLoader(dataset, **packed),
        "fixed-count": DataLoader(dataset, batch_size=fixed_b, shuffle=True, collate_fn=_flatten_collate(),
                                  generator=torch.Generator().manual_seed(0)),
        "trl-bfd": _trl_loader(dataset, budget, seed=0),
    }
    attn = {"odb-padded": "sdpa", "odb-packed-sdpa": "sdpa"}
    arms = [Arm(name, loader, dev, max_len, name.startswith("odb"), attn.get(name, PACKED_ATTN))
            for name, loader in loaders.items()]
    run_arms(arms, dev.type == "cpu", progress)
    res = {arm.name: arm.result() for arm in arms}
    ratio = res["odb-packed"]["real_tokens_per_s"] / res["odb-padded"]["real_tokens_per_s"]
    return {"device": str(dev), "samples": samples, "token_budget": budget, "max_len": max_len,
            "attn": {arm.name: arm.attn for arm in arms},
            "mean_length": float(lengths.mean()), "fixed_batch_size": fixed_b, "arms": list(res), **res,
            "packed_vs_padded": ratio,
            "vs": {k: res["odb-packed"]["real_tokens_per_s"] / r["real_tokens_per_s"]
                   for k, r in res.items() if k != "odb-packed"}}


def run_packing(n: int, train_samples: int, *, device: str = "cpu", real: bool = True,
                progress: Callable[..., Any] = lambda it, **kw: it) -> Dict[str, Any]:
    workloads = load_workloads(n, real=real)
    out = {"fill": packing_fill(workloads, progress=progress),
           "goals": {"fill_min": FILL_MIN, "vs_trl_max_gap": VS_TRL_MAX_GAP}}
    if train_samples:
        out["training"] = packing_training(train_samples, device=device, progress=progress)
    return out
