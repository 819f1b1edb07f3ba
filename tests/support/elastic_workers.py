"""Worker functions and datasets for tests/resume/test_elastic.py and tests/data/test_repeat_samplers.py.

Run on every rank by dist_harness.run_ranks as ``"elastic_workers:<name>"`` (one fresh
process per rank, gloo default group up), or called in the test process with world 1.
Each phase of an elastic test is one such run: a fresh set of processes, as after a
restart, that loads the states the previous phase saved to disk (JSON or torch.save),
iterates, and may save again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Sequence

import torch
from torch.utils.data import DistributedSampler, IterableDataset, get_worker_info

import odb
from helpers import LengthDataset, known_lengths, make_sample, pad_collate


def step_record(batch: Dict[str, Any]) -> Dict[str, Any]:
    info = odb.pop_step_info(batch)
    return {"step": info.micro_batch, "ids": list(info.sample_ids), "idx": list(batch["idx"]), "ghost": info.is_ghost,
            "scale": info.loss_scale, "padded": info.padded_tokens, "micro": [info.micro_step, info.micro_steps],
            "epoch": info.epoch}


def elastic_lengths(p: Dict[str, Any]) -> List[int]:
    return known_lengths(p["n"], 1, 60, seed=7)


def elastic_sampler(p: Dict[str, Any], ds: Any, world: int, rank: int) -> Any:
    if p["sampler"] == "distributed":  # pads the last ranks with repeated indices when n % world != 0
        return DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=3, drop_last=False)
    return odb.ShardSampler(ds, num_replicas=world, rank=rank, seed=3)


def elastic_loader(p: Dict[str, Any], world: int, rank: int, num_workers: int) -> odb.ODBDataLoader:
    ds = LengthDataset(elastic_lengths(p))
    return odb.ODBDataLoader(ds, token_budget=p["budget"], sampler=elastic_sampler(p, ds, world, rank),
                             num_workers=num_workers, collate_fn=pad_collate, buffer_size=p["buffer"],
                             first_window_size=16, seed=11, gradient_accumulation_steps=p.get("accumulation", 1),
                             lengths=elastic_lengths(p) if p.get("known") else None)


def save_state(state: Dict[str, Any], folder: str, rank: int, fmt: str) -> None:
    path = Path(folder) / f"state_rank{rank}.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(state))
    else:
        torch.save(state, path)


def read_states(folder: str) -> List[Dict[str, Any]]:
    """Every rank's saved state, as a fresh process finds them on disk (torch files with weights_only)."""
    out = []
    for path in sorted(Path(folder).glob("state_rank*"), key=lambda f: int(f.stem[len("state_rank"):])):
        if path.suffix == ".json":
            out.append(json.loads(path.read_text()))
        else:
            out.append(torch.load(path, weights_only=True))
    return out


def elastic_phase(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """One run of the job: load every rank's states of the last phase (if any), take ``stop`` batches
    and save (or finish the epoch and run the next one)."""
    loader = elastic_loader(p, world, rank, p["num_workers"])
    if p.get("load_from"):
        loader.load_state_dict(read_states(p["load_from"]))
    else:
        loader.set_epoch(p["epoch"])
    steps = []
    for batch in loader:
        steps.append(step_record(batch))
        if p.get("stop") is not None and len(steps) == p["stop"]:
            break
    out: Dict[str, Any] = {"steps": steps, "next": None}
    if p.get("save_to"):
        os.makedirs(p["save_to"], exist_ok=True)
        save_state(loader.state_dict(), p["save_to"], rank, p["format"])
    else:
        loader.set_epoch(p["epoch"] + 1)
        out["next"] = [step_record(b) for b in loader]
        out["expected_next"] = [int(i) for i in loader.sampler]
    return out


def repeated_shard(n: int, world: int, rank: int) -> List[int]:
    """This rank's indices with every third one listed twice (an upsampled mixture)."""
    shard = list(range(rank, n, world))
    return shard + shard[::3]


def repeats_under_ddp(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """Each rank's sampler lists some indices twice; one epoch, every step recorded."""
    ds = LengthDataset(known_lengths(p["n"], 1, 60, seed=9))
    order = repeated_shard(p["n"], world, rank)
    loader = odb.ODBDataLoader(ds, token_budget=p["budget"], sampler=order, collate_fn=pad_collate,
                               buffer_size=p["buffer"], seed=1, num_workers=p["num_workers"])
    return {"order": order, "steps": [step_record(b) for b in loader]}


class CountingStream(IterableDataset):
    """An IterableDataset with its own state (``{"next": k}``: the samples of this worker's share
    already yielded); ``reads`` counts the samples it built in this process (shared by copies)."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = list(lengths)
        self.reads = [0]
        self._start = 0
        self._next = 0

    def state_dict(self) -> Dict[str, Any]:
        return {"next": self._next}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._start = int(state["next"])

    def __iter__(self):
        info = get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None else (0, 1)
        share = list(range(first, len(self.lengths), step))
        start, self._start = self._start, 0
        for k in range(start, len(share)):
            self._next = k + 1
            self.reads[0] += 1
            yield make_sample(share[k], self.lengths[share[k]])


def hf_stream(n: int, shards: int, low: int = 1) -> Any:
    """A datasets.IterableDataset of tokenised-looking samples (input_ids, labels, idx), sharded.

    Built with the token columns in place: datasets 4.0's ``.map()`` on an iterable dataset
    loses its position at a shard's end (its state_dict then resumes past the shard), which
    would be the dataset's bug, not odb's."""
    import datasets

    lengths = known_lengths(n, low, 60, seed=12)
    ids = [[(7 * t + i) % 50 for t in range(lengths[i])] for i in range(n)]
    labels = [[t if k % 3 != 1 else -100 for k, t in enumerate(row)] for row in ids]
    table = datasets.Dataset.from_dict({"idx": list(range(n)), "input_ids": ids, "labels": labels})
    return table.to_iterable_dataset(num_shards=shards)


def list_collate(samples: List[Dict[str, Any]]) -> Dict[str, Any]:
    """pad_collate for samples whose sequences are lists (no pid/tag fields)."""
    rows = [dict(s, input_ids=torch.as_tensor(s["input_ids"]), labels=torch.as_tensor(s["labels"]), pid=None,
                 tag=None) for s in samples]
    return pad_collate(rows)


def stream_resume_ranks(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """A datasets.IterableDataset split by rank: an uninterrupted epoch, then the same epoch
    interrupted ``stop_before_end`` steps before its end and resumed (same world size) through the
    dataset's own state."""
    from datasets.distributed import split_dataset_by_node

    def make() -> odb.ODBDataLoader:
        stream = split_dataset_by_node(hf_stream(p["n"], p["shards"], p["low"]), rank=rank, world_size=world)
        return odb.ODBDataLoader(stream, token_budget=p["budget"], buffer_size=p["buffer"], first_window_size=16,
                                 collate_fn=list_collate, seed=4, num_workers=p["num_workers"])

    reference = [step_record(b) for b in make()]
    first = make()
    head = []
    for batch in first:
        head.append(step_record(batch))
        if len(head) == len(reference) - p["stop_before_end"]:  # late: the stream restarts well past its start
            break
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    return {"reference": reference, "resumed": head + [step_record(b) for b in resumed], "state": state}


def stream_phase_ranks(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """One phase of a run over a datasets.IterableDataset split by rank, as a fresh process after a restart:
    loads this rank's state from ``p['load']`` (when given), trains ``p['steps']`` steps (None: to the epoch's
    end) and saves its state to ``p['save']`` (when given); with ``p['reference']`` also the uninterrupted epoch."""
    from datasets.distributed import split_dataset_by_node

    def make() -> odb.ODBDataLoader:
        stream = split_dataset_by_node(hf_stream(p["n"], p["shards"], p["low"]), rank=rank, world_size=world)
        return odb.ODBDataLoader(stream, token_budget=p["budget"], buffer_size=p["buffer"], first_window_size=16,
                                 collate_fn=list_collate, seed=4, num_workers=p["num_workers"])

    out: Dict[str, Any] = {"reference": [step_record(b) for b in make()] if p.get("reference") else None}
    loader = make()
    if p.get("load"):
        loader.load_state_dict(json.loads(Path(p["load"], f"rank{rank}.json").read_text()))
    steps: List[Dict[str, Any]] = []
    for batch in loader:
        steps.append(step_record(batch))
        if p.get("steps") is not None and len(steps) == p["steps"]:
            break
    if p.get("save"):
        Path(p["save"]).mkdir(parents=True, exist_ok=True)
        Path(p["save"], f"rank{rank}.json").write_text(json.dumps(loader.state_dict()))
    out["steps"] = steps
    return out
