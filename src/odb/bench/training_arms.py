"""The loaders of the training benchmark's arms, each built as its users build it.

Every arm gets the same dataset and the same memory cap: a budget of padded tokens per
micro-batch (B x L). Fixed-size arms use the largest B whose worst case fits the cap
(``fixed_batch_size``), as a user who must not run out of memory picks it. Under DDP
each rank builds its own loader for its rank.

- ``fixed``: ``DataLoader(batch_size=B, shuffle=True)``; ``DistributedSampler`` under DDP;
- ``group_by_length``: transformers' ``LengthGroupedSampler`` (one process) or
  ``DistributedLengthGroupedSampler`` (DDP) at B;
- ``batch_rebalance``: transformers' ``BatchRebalanceSampler`` as ``Trainer`` builds it
  (effective batch B x world x grad_accum), planning over ``REBALANCE_GRAD_ACCUM``
  micro-batches; each micro-batch is trained as its own step here, as in every arm
  (the table says so);
- ``trl_packing``: ``trl.pack_dataset(strategy="bfd", seq_length=cap)`` as
  ``SFTTrainer(packing=True)`` calls it, rows of the cap shuffled (sharded under DDP),
  TRL's padding-free collator, trained with the ``odb_varlen`` attention;
- ``odb_padded``: ``odb.ODBDataLoader(token_budget=cap)`` at its defaults;
- ``odb_packed``: the same with ``layout="packed"``, trained with ``odb_varlen``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import odb

from odb.bench.text_data import PAD_ID, TextSamples, pad_collate

ARMS = ("fixed", "group_by_length", "batch_rebalance", "trl_packing", "odb_padded", "odb_packed")
ODB_ARMS = ("odb_padded", "odb_packed")
PACKED_ATTN = "odb_varlen"
ATTENTION = {"trl_packing": PACKED_ATTN, "odb_packed": PACKED_ATTN}  # others: sdpa over padded batches
REBALANCE_GRAD_ACCUM = 8


def fixed_batch_size(cap: int, lengths: Sequence[int]) -> int:
    """The largest B whose worst case (B x the longest sample) fits the cap (at least 1).

    Example:
        >>> fixed_batch_size(4096, [100, 1024, 300]), fixed_batch_size(4096, [5000])
        (4, 1)
    """
    return max(1, int(cap) // int(np.max(lengths)))


def arm_settings(b: int, world: int) -> Dict[str, str]:
    """Each arm's settings in words, for the table (anything not at its default is named)."""
    return {
        "fixed": f"batch_size={b}, shuffle" + (", DistributedSampler" if world > 1 else ""),
        "group_by_length": f"{'Distributed' if world > 1 else ''}LengthGroupedSampler, batch_size={b}",
        "batch_rebalance": f"BatchRebalanceSampler(effective_batch_size={b}x{world}x{REBALANCE_GRAD_ACCUM}, "
                           f"grad_accum={REBALANCE_GRAD_ACCUM}); each micro-batch one optimizer step",
        "trl_packing": "trl.pack_dataset(strategy='bfd', seq_length=cap), padding_free collator, odb_varlen",
        "odb_padded": "ODBDataLoader(token_budget=cap, shift_labels=True), defaults otherwise",
        "odb_packed": "ODBDataLoader(token_budget=cap, layout='packed', shift_labels=True), defaults otherwise, "
                      "odb_varlen",
    }


class _Rows(Dataset):
    def __init__(self, rows: Any) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return self.rows[i]


def trl_rows(dataset: TextSamples, cap: int) -> Any:
    """The packed rows of ``trl.pack_dataset`` over the dataset's samples (preprocessing: built once)."""
    import datasets
    from trl import pack_dataset

    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"input_ids": [dataset[i]["input_ids"].tolist() for i in range(len(dataset))]})
    return pack_dataset(ds, seq_length=cap, strategy="bfd")


def _sampler(data: Dataset, rank: int, world: int, seed: int) -> Optional[DistributedSampler]:
    if world <= 1:
        return None
    return DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=seed)


def build_loader(arm: str, dataset: TextSamples, cap: int, *, rank: int = 0, world: int = 1, seed: int = 0,
                 rows: Any = None) -> DataLoader:
    """The loader of ``arm`` (one of ``ARMS``) for this rank; ``rows``: ``trl_rows`` (trl_packing only)."""
    lengths: List[int] = dataset.lengths.tolist()
    b = fixed_batch_size(cap, lengths)
    g = torch.Generator().manual_seed(seed)
    if arm == "fixed":
        sampler = _sampler(dataset, rank, world, seed)
        return DataLoader(dataset, batch_size=b, shuffle=sampler is None, sampler=sampler, generator=g,
                          collate_fn=pad_collate)
    if arm == "group_by_length":
        from transformers.trainer_pt_utils import DistributedLengthGroupedSampler, LengthGroupedSampler

        grouped: Any = (LengthGroupedSampler(b, lengths=lengths, generator=g) if world <= 1 else
                        DistributedLengthGroupedSampler(b, num_replicas=world, rank=rank, seed=seed, lengths=lengths))
        return DataLoader(dataset, batch_size=b, sampler=grouped, collate_fn=pad_collate)
    if arm == "batch_rebalance":
        from transformers.trainer_pt_utils import BatchRebalanceSampler

        batches = BatchRebalanceSampler(lengths=lengths, effective_batch_size=b * world * REBALANCE_GRAD_ACCUM,
                                        dp_size=world, grad_accum=REBALANCE_GRAD_ACCUM, rank=rank, seed=seed,
                                        drop_last=False)
        return DataLoader(dataset, batch_sampler=batches, collate_fn=pad_collate)
    if arm == "trl_packing":
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        if rows is None:
            rows = trl_rows(dataset, cap)
        data = _Rows(rows)
        sampler = _sampler(data, rank, world, seed)
        return DataLoader(data, batch_size=1, shuffle=sampler is None, sampler=sampler, generator=g,
                          collate_fn=DataCollatorForLanguageModeling(pad_token_id=PAD_ID, padding_free=True))
    if arm in ODB_ARMS:
        sampler = _sampler(dataset, rank, world, seed)
        # shift_labels: labels = input_ids of a causal LM, which shifts them (odb warns without it); no speed effect.
        options: Dict[str, Any] = {"shift_labels": True}
        options.update({"layout": "packed"} if arm == "odb_packed" else {"collate_fn": pad_collate})
        if sampler is None:
            return odb.ODBDataLoader(dataset, token_budget=cap, shuffle=True, seed=seed, **options)
        return odb.ODBDataLoader(dataset, token_budget=cap, sampler=sampler, seed=seed, **options)
    raise ValueError(f"unknown training arm {arm!r}; known: {', '.join(ARMS)}")
