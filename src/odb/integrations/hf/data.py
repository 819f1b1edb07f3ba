"""The HF Trainer's training loader as an odb loader, its step estimate, and odb's checkpoint file.

The loader is built the way ``Trainer.get_train_dataloader`` builds its own (collator
with unused columns removed, workers, pinning, worker seeding, drop_last) except that
it is not passed through ``accelerator.prepare``: that would re-shard or dispatch odb's
batches across ranks. Each rank instead reads its own share of the dataset through an
``odb.ShardSampler`` (every sample to exactly one rank; under ``group_by_length`` and
``batch_rebalance`` the Trainer's own sampler dealt as Accelerate deals it: odb.integrations.hf.sampling)
and odb aligns the ranks.
"""

from __future__ import annotations

import json
import os
from functools import partial
from typing import Any, Dict, Optional, Sequence

import numpy as np
from torch.utils.data import IterableDataset

from odb.config import ODBConfig
from odb.loader.length_probe import first_oversize
from odb.loader.dataloader import ODBDataLoader
from odb.data.sampling import ShardSampler
from odb.integrations.hf.sampling import epoch_draw, trainer_sampler
from odb.integrations.trl.vision import vision_samples
from odb.integrations.vlm import imageless_guard

STATE_VERSION = 1


def state_file(checkpoint_dir: str, rank: int) -> str:
    """Where a rank's odb state lives inside a Trainer checkpoint folder."""
    return os.path.join(checkpoint_dir, f"odb_state_rank{rank}.json")


def is_hf_dataset(dataset: Any) -> bool:
    from transformers.utils import is_datasets_available

    if not is_datasets_available():
        return False
    import datasets

    return isinstance(dataset, datasets.Dataset)


def build_train_loader(trainer: Any, cfg: ODBConfig, lengths: Optional[Sequence[int]]) -> ODBDataLoader:
    """An ODBDataLoader over ``trainer.train_dataset`` with the Trainer's data settings."""
    from transformers.trainer_utils import seed_worker

    args = trainer.args
    dataset, collator = trainer.train_dataset, trainer.data_collator
    # TRL's vision-language collator processes samples: odb reads each one processed alone, then pads them
    dataset, collator, processed = vision_samples(dataset, collator)
    if processed:
        pass  # TRL's collator reads only its own fields of the raw samples
    elif is_hf_dataset(dataset):
        dataset = trainer._remove_unused_columns(dataset, description="Training")
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description="Training")
    # a vision-language model's image-less micro-batch gets a dummy image, so no rank skips the vision tower
    collator = imageless_guard(collator, trainer.model, world_size=args.world_size,
                               ddp_finds_unused=ddp_finds_unused(trainer))
    shuffle = getattr(args, "train_sampling_strategy", "random") != "sequential"
    # group_by_length, batch_rebalance: the Trainer's own sampler (over the dataset it would sample: the raw
    # one when TRL's collator processes samples), dealt to the ranks as Accelerate deals it
    sampler, generator = trainer_sampler(trainer, trainer.train_dataset if processed else dataset)
    if sampler is None and not isinstance(dataset, IterableDataset):
        sampler = ShardSampler(dataset, num_replicas=args.world_size, rank=args.process_index, shuffle=shuffle,
                               seed=int(cfg.seed or 0))
    workers = args.dataloader_num_workers
    options: Dict[str, Any] = {}
    b, a = args.per_device_train_batch_size, args.gradient_accumulation_steps
    if cfg.global_batch_size == b * a * args.world_size:
        # the Trainer's own step, said as its batch: drop_last then drops only a rank's partial last batch of
        # per_device_train_batch_size and steps on the rest, as the Trainer does (odb.epoch.drop_last)
        cfg = cfg.replace(global_batch_size=None, gradient_accumulation_steps=a)
        options["batch_size"] = b
    if hasattr(args, "dataloader_in_order"):
        options["in_order"] = args.dataloader_in_order
    return ODBDataLoader(
        dataset, config=cfg, sampler=sampler, shuffle=None if sampler is not None else shuffle,  # as the sampler
        collate_fn=collator, num_workers=workers,
        pin_memory=args.dataloader_pin_memory, persistent_workers=args.dataloader_persistent_workers and workers > 0,
        multiprocessing_context=getattr(args, "dataloader_multiprocessing_context", None) if workers > 0 else None,
        prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
        drop_last=args.dataloader_drop_last, lengths=lengths, generator=generator,
        worker_init_fn=partial(seed_worker, num_workers=workers, rank=args.process_index), **options)


def ddp_finds_unused(trainer: Any) -> bool:
    """Whether the Trainer wraps its model in plain DDP with ``find_unused_parameters=True`` (no FSDP, DeepSpeed
    or parameters sharded at load), which tolerates a rank that skips a module."""
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        return False
    if any(type(w).__name__ == "DTensor" for w in trainer.model.parameters()):
        return False
    handler = getattr(trainer.accelerator, "ddp_handler", None)
    return bool(getattr(handler, "find_unused_parameters", False))


def check_fits(trainer: Any, cfg: ODBConfig, lengths: Optional[Sequence[int]]) -> None:
    """Refuse, when the Trainer is configured, a training sample that alone exceeds the budget.

    Only lengths known cheaply are checked: ``lengths=``, or a ``datasets.Dataset`` with an
    ``input_ids`` column measured from its Arrow offsets (no sample is read; TRL's prepared
    dataset is one). Otherwise the first ``len()`` of the loader, at ``train()``, finds it.
    """
    if cfg.oversize != "error" or cfg.image_patches_key is not None or cfg.auto:
        return  # token_budget="auto": no budget yet (the memory model refuses a sample no batch can hold)
    if lengths is None and cfg.length_fn is None:
        lengths = arrow_lengths(trainer.train_dataset, cfg)
    found = first_oversize(lengths, cfg) if lengths is not None else None
    if found is None:
        return
    index, length, needed = found
    values = np.asarray(lengths)
    if values.ndim == 1:  # name the longest sample: the budget it needs fits every sample
        index = int(np.argmax(values))
        _, length, needed = first_oversize(values[index:index + 1], cfg) or found
    shown = length[0] if len(length) == 1 else length
    args = trainer.args
    limit = getattr(args, "max_length", None)  # TRL's SFTConfig truncates samples to it
    if limit is not None and len(length) == 1:
        cap = f"set max_length={longest_fitting(cfg)} or less in the SFTConfig (now {limit}; TRL truncates " \
              f"samples to it)"
    else:
        cap = "truncate samples when tokenizing (tokenizer(..., truncation=True, max_length=...))"
    padded = f" (padded to a multiple of {cfg.pad_to_multiple_of})" if cfg.pad_to_multiple_of > 1 else ""
    raise ValueError(f"sample {index} of the training dataset has length {shown}, so alone it exceeds "
                     f"token_budget={cfg.token_budget}{padded}. Rule: oversize='error' refuses such samples, and "
                     f"training would stop when odb reaches it. Fix: raise token_budget to at least {needed}, {cap}, or pass oversize='alone' (its own "
                     f"batch) or 'skip'.")


def longest_fitting(cfg: ODBConfig) -> int:
    """The longest one-dimensional sample that fits the budget alone (0 when none does)."""
    low, high = 0, int(sum(cfg.token_budgets))
    while low < high:  # the longest L with first_oversize([L]) None
        mid = (low + high + 1) // 2
        low, high = (mid, high) if first_oversize([mid], cfg) is None else (low, mid - 1)
    return low


def arrow_lengths(dataset: Any, cfg: ODBConfig) -> Optional[np.ndarray]:
    """Per-sample lengths of a ``datasets.Dataset``'s ``input_ids`` when one may exceed the budget; None when
    the dataset has no such column or every row of its Arrow table fits (read from list offsets only)."""
    if not is_hf_dataset(dataset) or "input_ids" not in dataset.column_names:
        return None
    import pyarrow as pa
    import pyarrow.compute as pc

    table = dataset.data  # the rows behind any select/shuffle view: a superset of the dataset's
    column = table.column("input_ids")
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        return None
    raw = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    if first_oversize(raw, cfg) is None:
        return None
    view = dataset.with_format("arrow")["input_ids"]  # this dataset's own rows, in order (only on this rare path)
    return pc.list_value_length(view).to_numpy(zero_copy_only=False).astype(np.int64)


def estimate_micro_steps(loader: ODBDataLoader, cfg: ODBConfig, lengths: Optional[Sequence[int]],
                         world_size: int) -> Optional[int]:
    """Micro-batches per epoch per rank, the same number on every rank; None without a length.

    odb's own estimate (``len(loader)``) depends on the rank's shard size, which differs
    by one sample between ranks; the learning-rate schedule and the Trainer's logging
    intervals are derived from this number and must agree on all ranks, so it is taken
    from the whole dataset and divided by the world size.
    """
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        return None
    whole = ODBDataLoader(dataset, config=cfg.replace(seed=cfg.seed or 0), lengths=lengths, collate_fn=list)
    return max(1, -(-len(whole) // max(world_size, 1)))


def write_state(checkpoint_dir: str, rank: int, world_size: int, loader: ODBDataLoader,
                progress: Dict[str, Any]) -> None:
    """Save this rank's loader position and sample progress into a Trainer checkpoint folder."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    state = {"odb_hf_state_version": STATE_VERSION, "rank": rank, "world_size": world_size,
             "progress": progress, "loader": loader.state_dict()}
    drawn = epoch_draw(loader)
    if drawn is not None:  # group_by_length: what draws the epoch's order again (odb.integrations.hf.sampling)
        state["order"] = drawn.state()
    path = state_file(checkpoint_dir, rank)
    with open(path + ".part", "w", encoding="utf-8") as f:
        json.dump(state, f)
    os.replace(path + ".part", path)


def read_state(checkpoint_dir: str, rank: int, world_size: int, strict: bool = True) -> Optional[Dict[str, Any]]:
    """This rank's saved odb state, or None when the checkpoint has none (saved without odb).

    ``strict=False`` (the data is not resumed mid-epoch) only needs the sample progress,
    which is the same on every rank: any rank's file will do, whatever the world size.
    When the checkpoint was saved by another number of processes, ``"loader"`` is the list
    of every saved rank's loader state, which ``ODBDataLoader.load_state_dict``
    re-partitions over this run's ranks (elastic resume).
    """
    saved = sorted(int(name[len("odb_state_rank"):-len(".json")]) for name in os.listdir(checkpoint_dir)
                   if name.startswith("odb_state_rank") and name.endswith(".json"))
    if not saved:
        return None
    state = _read_file(state_file(checkpoint_dir, saved[0]))  # rank 0's: it names the saved world size
    saved_world = state.get("world_size")
    if not strict:
        return state
    if saved_world == world_size:
        if rank not in saved:
            raise ValueError(f"checkpoint {checkpoint_dir} holds odb states of ranks {saved} but none for rank "
                             f"{rank} of {world_size}: a file is missing. Fix: copy every odb_state_rank*.json "
                             f"of the checkpoint, or pass ignore_data_skip=True to start the epoch's data afresh.")
        return state if rank == saved[0] else _read_file(state_file(checkpoint_dir, rank))
    missing = [r for r in range(saved_world) if r not in saved] if isinstance(saved_world, int) else saved
    if missing:
        raise ValueError(f"checkpoint {checkpoint_dir} was saved by {saved_world!r} rank(s) but has no odb state of "
                         f"rank(s) {missing}: resuming on {world_size} rank(s) re-partitions the epoch and needs "
                         f"every saved rank's state. Fix: copy every odb_state_rank*.json of the checkpoint, or "
                         f"pass ignore_data_skip=True to start the epoch's data afresh.")
    # files of ranks >= saved_world are left over from an earlier run that saved into the same folder
    states = [state if r == state.get("rank") else _read_file(state_file(checkpoint_dir, r))
              for r in range(saved_world)]
    return dict(state, loader=[s["loader"] for s in states])


def epoch_emitted(loader_state: Any) -> bool:
    """Whether a saved loader state (one rank's, or the list of every saved rank's) had emitted its whole epoch."""
    states = loader_state if isinstance(loader_state, list) else [loader_state]
    return all(s["run"] is None for s in states)


def _read_file(path: str) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        state = json.load(f)
    if state.get("odb_hf_state_version") != STATE_VERSION:
        raise ValueError(f"{path} has odb state version {state.get('odb_hf_state_version')!r}; this odb reads "
                         f"version {STATE_VERSION}. Fix: resume with the odb version that saved it.")
    return state
