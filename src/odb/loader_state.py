"""The loader's resume API: state_dict() and load_state_dict() (see odb.resume for the state).

A DataLoader subclass (never built directly) between DataLoader and ODBLoaderMixin, so
that odb.apply can still switch a loader's class in place.
"""

from __future__ import annotations

import json
from typing import Any, Dict

from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

from .resume import PLAN_OPTIONS, STATE_VERSION, check_state, cursor_state, retained_ids
from .sampling import EpochShuffleSampler, ShardSampler
from .source import SampleMeter


class ResumableLoader(DataLoader):
    """state_dict / load_state_dict of odb loaders (attributes are set by ODBLoaderMixin)."""

    def state_dict(self) -> Dict[str, Any]:
        """Where this loader is, as plain data: ``load_state_dict`` on a fresh loader built with the
        same arguments continues with exactly the batches this one has not emitted yet.

        Call it between batches (e.g. when the trainer checkpoints). Each rank saves its own.
        """
        run, cursor = self._odb_run, self._odb_cursor
        run_state = None
        if run is not None and self._odb_last_steps_epoch != run.epoch:
            # The batches the training loop received, not what the background thread planned ahead.
            run_state = cursor_state(cursor, self._odb_cfg.gradient_accumulation_steps)
            run_state["stats"]["wait_s"] = self.odb_stats["wait_s"]
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
                "run": run_state}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from ``state_dict()`` at the next ``iter()`` (strict: refuses another world size,
        dataset length or planning options, with the reason)."""
        rank, world_size = self._odb_world()
        check_state(state, world_size=world_size, rank=rank,
                    dataset_len=None if self._odb_is_iterable() else len(self.dataset),
                    iterable=self._odb_is_iterable(), options=self._odb_plan_options())
        if self._odb_own_sampler is None and not _replayable(self.sampler) and not self._odb_is_iterable():
            raise ValueError(f"odb cannot resume mid-epoch with sampler {type(self.sampler).__name__}: its order "
                             f"is not a function of (seed, epoch). Fix: use shuffle=True of ODBDataLoader (seeded), "
                             f"odb.ShardSampler, DistributedSampler or a SequentialSampler.")
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

    def _odb_plan_options(self) -> Dict[str, Any]:
        # As JSON would give them back (tuples become lists), so saved and current compare equal.
        return json.loads(json.dumps({k: getattr(self._odb_cfg, k) for k in PLAN_OPTIONS}))

    def _odb_retained(self, source: Any, run_state: Dict[str, Any], known: Any = None) -> Dict[int, Any]:
        """The samples a resumed epoch needs again (carried, planned, ghost), as id -> (sample, meta)."""
        ids = retained_ids(run_state)
        if known is not None:  # index-only records: nothing to read
            return {i: (i, (tuple(int(v) for v in known[i]), 0, 0)) for i in ids}
        if self._odb_is_iterable():
            return source.skip(run_state["arrived"], ids)
        transform, meter = self._odb_transform, SampleMeter(self._odb_cfg)
        out = {}
        for i in ids:
            sample = self.dataset[i] if transform is None else transform(self.dataset[i])
            out[i] = (sample, meter(i, sample))
        return out


def _replayable(sampler: Any) -> bool:
    """Samplers whose order is a function of (seed, epoch), so a resumed epoch sees the same order."""
    return isinstance(sampler, (SequentialSampler, DistributedSampler, ShardSampler, EpochShuffleSampler))
