"""One resume round trip of an odb loader, shared by the tests that check exact resume.

The pattern every resume test runs: read part of an epoch from a loader, take its
``state_dict()``, build a fresh loader with the same arguments, ``load_state_dict`` the
state into it, read the rest of the epoch, and compare the interrupted run's batches
with an uninterrupted one's::

    from roundtrip import read, round_trip

    reference = read(make())                  # the uninterrupted epoch
    got = round_trip(make, stop=5)            # 5 batches, save, a fresh make(), load, the rest
    assert got.epoch == reference             # head + rest

What a test compares is what ``record(batch, info)`` makes of each batch (``info`` is
the batch's popped step info; the default, ``step_record``, keeps the sample ids, step,
loss scale, micro-step and ghost flag). Options cover the variants the tests need: how
the state travels (``save``: through JSON by default, ``same`` for the object itself,
``torch_copy`` for ``torch.save``/``torch.load(weights_only=True)``, or any function,
e.g. one that wraps it in a list), the epoch the interrupted loader starts at
(``epoch``), a state taken while the first loader is still iterating (``live``, with an
optional ``pause`` that lets its batch thread run ahead), and the epoch after the
resumed one (``next_epoch``).
"""

from __future__ import annotations

import io
import itertools
import json
import time
from typing import Any, Callable, List, NamedTuple, Optional

import torch

import odb

Record = Callable[[Any, odb.ODBStepInfo], Any]


def step_record(batch: Any, info: odb.ODBStepInfo) -> dict:
    """What a resume must reproduce of a batch: its samples, step, loss scale, place in the step, ghost flag."""
    return {"ids": list(info.sample_ids), "step": info.micro_batch, "scale": info.loss_scale,
            "micro": [info.micro_step, info.micro_steps], "ghost": info.is_ghost}


def sample_ids(batch: Any, info: odb.ODBStepInfo) -> List[int]:
    """The batch's sample ids, as a list."""
    return list(info.sample_ids)


def read(loader: Any, limit: Optional[int] = None, record: Record = step_record) -> List[Any]:
    """``record(batch, info)`` of each batch of ``loader`` (the step info popped), the first ``limit`` only if given."""
    batches = loader if limit is None else itertools.islice(loader, limit)
    out = []
    for batch in batches:
        out.append(record(batch, odb.pop_step_info(batch)))
    return out


def json_copy(state: Any) -> Any:
    """The state as it comes back from JSON (plain data only, tuples become lists)."""
    return json.loads(json.dumps(state))


def torch_copy(state: Any) -> Any:
    """The state as it comes back from ``torch.save`` and ``torch.load(weights_only=True)``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def same(state: Any) -> Any:
    """The state object itself, as a checkpoint kept in memory would hand it back."""
    return state


class RoundTrip(NamedTuple):
    head: List[Any]  # the records of the batches read before the interruption
    rest: List[Any]  # the records of the rest of the epoch, read from the resumed loader
    next_epoch: Optional[List[Any]]  # the records of the epoch after it (next_epoch=True), else None
    state: Any  # what the interrupted loader's state_dict() returned
    loaded: Any  # what the resumed loader's load_state_dict() got: save(state)
    resumed: Any  # the resumed loader (iterated)

    @property
    def epoch(self) -> List[Any]:
        """The interrupted epoch as the training loop saw it: the head, then the rest."""
        return self.head + self.rest


def round_trip(make: Callable[[], Any], stop: int, *, record: Record = step_record,
               save: Callable[[Any], Any] = json_copy, epoch: Optional[int] = None, live: bool = False,
               pause: float = 0.0, next_epoch: bool = False) -> RoundTrip:
    """Interrupt an epoch of ``make()`` after ``stop`` batches and resume it in a fresh ``make()``.

    ``epoch``: ``set_epoch`` on the interrupted loader before it runs (the resumed one
    learns its epoch from the state). ``live``: the state is taken while the interrupted
    loader's iterator is still open (as a training loop saves), after ``pause`` seconds;
    else after its iteration stopped. Returns the records and the state (``RoundTrip``).
    """
    first = make()
    if epoch is not None:
        first.set_epoch(epoch)
    running = None
    if live:
        running = iter(first)
        head = [record(batch, odb.pop_step_info(batch)) for batch in itertools.islice(running, stop)]
        time.sleep(pause)
    else:
        head = read(first, stop, record) if stop else []
    assert len(head) == stop, f"the epoch ended after {len(head)} batches, before the interruption at {stop}"
    state = first.state_dict()
    loaded = save(state)
    resumed = make()
    resumed.load_state_dict(loaded)
    rest = read(resumed, record=record)
    following = read(resumed, record=record) if next_epoch else None
    del running  # the interrupted iteration ends here
    return RoundTrip(head, rest, following, state, loaded, resumed)
