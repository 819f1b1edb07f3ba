"""The loader's resume API: state_dict() and load_state_dict() (see odb.resume for the state).

A DataLoader subclass (never built directly) between DataLoader and ODBLoaderMixin, so
that odb.apply can still switch a loader's class in place.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

from odb.resume.elastic import check_group, rank_order, repartition
from odb.resume.state import PLAN_OPTIONS, STATE_VERSION, check_state, cursor_state, retained_positions
from odb.data.sampling import EpochShuffleSampler, ShardSampler, sampler_settings
from odb.data.source import SampleMeter


class ResumableLoader(DataLoader):
    """state_dict / load_state_dict of odb loaders (attributes are set by ODBLoaderMixin)."""

    def state_dict(self) -> Dict[str, Any]:
        """Where this loader is, as plain data: ``load_state_dict`` on a fresh loader built with the
        same arguments continues with exactly the batches this one has not emitted yet.

        Call it between batches (e.g. when the trainer checkpoints; it costs well under a
        millisecond, so every step is fine). Each rank saves its own. The dict holds only ints,
        floats, bools, strings, lists and dicts: save it with ``json.dump`` or ``torch.save``
        (it loads with ``torch.load(..., weights_only=True)``).

        Example:
            >>> import json, torch, odb
            >>> data = [{"input_ids": torch.ones(n, dtype=torch.long)} for n in (5, 3, 8, 2)]
            >>> loader = odb.ODBDataLoader(data, token_budget=16, buffer_size=4, collate_fn=list)
            >>> first = next(iter(loader))
            >>> fresh = odb.ODBDataLoader(data, token_budget=16, buffer_size=4, collate_fn=list)
            >>> fresh.load_state_dict(json.loads(json.dumps(loader.state_dict())))
            >>> [odb.pop_step_info(b).sample_ids for b in fresh]
            [(1, 3)]
        """
        run, cursor = self._odb_run, self._odb_cursor
        run_state = None
        if run is not None and self._odb_last_steps_epoch != run.epoch:
            # The batches the training loop received, not what the background thread planned ahead.
            run_state = cursor_state(cursor, self._odb_cfg.gradient_accumulation_steps)
            run_state["stats"]["wait_s"] = self._odb_wait_s()
            if run.stream_marks is not None:  # a later restart point of the stream, if the batches since allow
                later = run.stream_marks.cut(min(retained_positions(run_state), default=run_state["arrived"]),
                                             prune=False)
                if later is not None and later["start"] > run_state["stream"]["start"]:
                    run_state["stream"] = later
            # After an epoch's last batch the epoch is over even if the iterator was not exhausted.
            if run_state["all_done"] and not run_state["pending"] and run_state["chunk_pos"] >= len(
                    run_state["chunk"]):
                run_state = None
        rank, world_size = self._odb_world()
        return {"odb_state_version": STATE_VERSION,
                "epoch": run.epoch if run_state is not None else self._odb_next_epoch,
                "seed": self._odb_seed, "world_size": world_size, "rank": rank,
                "dataset_len": None if self._odb_is_iterable() else len(self.dataset),
                "iterable": self._odb_is_iterable(), "options": self._odb_plan_options(),
                "sampler": self._odb_sampler_settings(), "num_workers": int(self.num_workers), "run": run_state}

    def load_state_dict(self, state: Union[Dict[str, Any], Sequence[Dict[str, Any]]]) -> None:
        """Continue from ``state_dict()`` at the next ``iter()``.

        ``state`` is this rank's own state (same world size), or the list of every rank's
        states: with another world size the interrupted epoch is re-partitioned over this
        one's ranks (map-style data, ``odb.ShardSampler`` or ``DistributedSampler``; see
        docs/resume.md). Strict: refuses another dataset, sampler or planning options, with
        the reason and the fix.
        """
        rank, world_size = self._odb_world()
        iterable = self._odb_is_iterable()
        expected = dict(dataset_len=None if iterable else len(self.dataset), iterable=iterable,
                        options=self._odb_plan_options(), sampler=self._odb_sampler_settings(),
                        num_workers=int(self.num_workers))
        if isinstance(state, (list, tuple)):
            states = list(state)
            for one in states:
                check_state(one, world_size=world_size, rank=rank, any_rank=True, **expected)
            mine = [s for s in states if s["world_size"] == world_size and s["rank"] == rank]
            if len(states) == world_size and len(mine) == 1:
                state = mine[0]  # the same world size: exactly where this rank stopped
            else:
                state = repartition(check_group(states, self.sampler, iterable), self.sampler, world_size, rank)
        else:
            check_state(state, world_size=world_size, rank=rank, **expected)
        if self._odb_own_sampler is None and not _replayable(self.sampler) and not iterable:
            raise ValueError(f"odb cannot resume mid-epoch with sampler {type(self.sampler).__name__}: its order "
                             f"is not a function of (seed, epoch). Fix: use shuffle=True of ODBDataLoader (seeded), "
                             f"odb.ShardSampler, DistributedSampler, a SequentialSampler or a fixed list of indices.")
        self._odb_seed = int(state["seed"])
        if self._odb_own_sampler is not None:
            self._odb_own_sampler.seed = self._odb_seed
        self._odb_resume = state if state["run"] is not None else None
        self._odb_next_epoch = int(state["epoch"])
        if self._odb_own_sampler is None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(int(state["epoch"]))  # the saved epoch's order (DistributedSampler, ShardSampler)
        self._odb_stop()
        self._odb_run = None
        self._odb_cursor = None
        if self._odb_stream is not None:
            self._odb_inner = None  # persistent workers hold a copy of the stream: start fresh ones with its state

    def _odb_plan_options(self) -> Dict[str, Any]:
        # As JSON would give them back (tuples become lists), so saved and current compare equal.
        cached = getattr(self, "_odb_options_cache", None)
        if cached is None or cached[0] is not self._odb_cfg:
            cached = (self._odb_cfg, json.loads(json.dumps({k: getattr(self._odb_cfg, k) for k in PLAN_OPTIONS})))
            self._odb_options_cache = cached
        return dict(cached[1])

    def _odb_sampler_settings(self) -> Optional[Dict[str, Any]]:
        """What fixes the order of the epoch's positions: the sampler's class (and a sharded one's settings)."""
        if self._odb_is_iterable():
            return None
        return sampler_settings(self.sampler) or {"kind": type(self.sampler).__name__}

    def _odb_resume_order(self, run_state: Optional[Dict[str, Any]], epoch: int) -> Optional[np.ndarray]:
        """This rank's order of a resumed epoch that was re-partitioned (None: the sampler's own)."""
        if run_state is None or not run_state["layers"]:
            return None
        rank, world_size = self._odb_world()
        return rank_order(self.sampler, run_state["layers"], world_size, rank, epoch)

    def _odb_retained(self, source: Any, run_state: Dict[str, Any], known: Any = None,
                      order: Optional[np.ndarray] = None) -> Dict[int, Any]:
        """The samples a resumed epoch needs again (carried, planned, ghost), as
        position -> (dataset index, sample, meta)."""
        positions = sorted(retained_positions(run_state))
        if self._odb_is_iterable():  # read again from the stream's restart point (or its start)
            stream = run_state["stream"]
            return source.skip(run_state["arrived"] - (stream["start"] if stream else 0), positions)
        indices = _indices_at(self.sampler if order is None else order, positions)
        if known is not None:  # index-only records: nothing to read
            return {p: (i, i, (tuple(int(v) for v in known[i]), 0, 0)) for p, i in zip(positions, indices)}
        transform, meter = self._odb_transform, SampleMeter(self._odb_cfg)
        out = {}
        for p, i in zip(positions, indices):
            sample = self.dataset[i] if transform is None else transform(self.dataset[i])
            out[p] = (i, sample, meter(i, sample))
        return out


def _indices_at(order: Any, positions: List[int]) -> List[int]:
    """Dataset indices at ascending ``positions`` of an epoch's order (read up to the last one)."""
    if not positions:
        return []
    head = list(itertools.islice(iter(order), positions[-1] + 1))
    if len(head) <= positions[-1]:
        raise ValueError(f"odb state holds position {positions[-1]} of the epoch's order, but the sampler yields only "
                         f"{len(head)} indices: the sampler differs from the saved run's. Fix: build the loader with "
                         f"the saved sampler and its settings.")
    return [int(head[p]) for p in positions]


def _replayable(sampler: Any) -> bool:
    """Samplers whose order is a function of (seed, epoch), so a resumed epoch sees the same order."""
    return isinstance(sampler, (SequentialSampler, DistributedSampler, ShardSampler, EpochShuffleSampler, list,
                                tuple, range))
