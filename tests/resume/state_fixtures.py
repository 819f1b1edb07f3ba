"""Loader states saved by earlier odb versions, kept as fixtures: a state saved before an upgrade must
still resume (tests/resume/test_saved_states.py).

``CASES`` names the loaders the fixtures were saved from. Each fixture (``states/v<N>_<case>.json``) holds
the state one of them saved after ``stop`` batches, and the records (odb's sample ids, step, loss scale,
micro-step, ghost flag) of the rest of that epoch as the uninterrupted loader made them. Run this file to
add the current version's fixtures (existing files are kept: they are what older versions saved)::

    PYTHONPATH=src .venv/bin/python tests/resume/state_fixtures.py
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch

import odb

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from helpers import LengthDataset, known_lengths, pad_collate  # noqa: E402
from odb.train.memory import ActivationMeter  # noqa: E402
from roundtrip import step_record  # noqa: E402

STATES = Path(__file__).resolve().parent / "states"
LENGTHS = known_lengths(200, 1, 40, seed=3)


class Stepper:
    """A tiny model whose forward the loader's memory meter sees (token_budget="auto" learns from it)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64))
        self.meter = ActivationMeter(self.model)

    def __call__(self, batch: Dict[str, Any]) -> None:
        out = self.model(batch["input_ids"])
        out.float().sum().backward()


def _counting_clock() -> Callable[[], float]:
    ticks = itertools.count()
    return lambda: float(next(ticks))


def make(case: str) -> Any:
    """(loader, step function or None) of a fixture case."""
    common = dict(collate_fn=pad_collate, shuffle=True, seed=1, buffer_size=48, shift_labels=False)
    data = LengthDataset(LENGTHS)
    if case == "padded_accumulation":
        return odb.ODBDataLoader(data, token_budget=96, gradient_accumulation_steps=2, **common), None
    if case == "global_batch_packed":
        packed = dict(common, collate_fn=odb.PackedCollate())  # (the collate makes no difference to the plan)
        return odb.ODBDataLoader(data, token_budget=128, global_batch_size=16, layout="packed", **packed), None
    if case == "length_grouped":  # saved inside a composed block (its queued steps held), inside a step
        return odb.ODBDataLoader(data, token_budget=96, global_batch_size=16, composition="length_grouped",
                                 composition_block_steps=4, **common), None
    if case == "auto":
        stepper = Stepper()
        loader = odb.ODBDataLoader(data, token_budget="auto", memory_cap_bytes=136 * 300,
                                   memory_meter=stepper.meter, **common)
        loader.odb_core.auto.clock = _counting_clock()
        return loader, stepper
    raise KeyError(case)


# case -> batches before the save (length_grouped: from version 5, which added step compositions)
CASES = {"padded_accumulation": 7, "global_batch_packed": 9, "auto": 25, "length_grouped": 11}


def records(loader: Any, step: Any, limit: Any = None) -> List[Any]:
    """``step_record`` of each batch (its step run first, when the case trains)."""
    out = []
    for batch in itertools.islice(loader, limit):
        info = odb.pop_step_info(batch)
        if step is not None:
            step(batch)
        out.append(step_record(batch, info))
    return out


def save(version: int) -> None:
    for case, stop in CASES.items():
        path = STATES / f"v{version}_{case}.json"
        if path.exists():
            continue
        loader, step = make(case)
        head = records(loader, step, stop)
        state = loader.state_dict()
        rest = records(*make(case))[stop:]  # the uninterrupted epoch's rest
        assert len(head) == stop and rest
        path.write_text(json.dumps({"case": case, "stop": stop, "state": state, "rest": rest}))
        print(f"wrote {path}")


if __name__ == "__main__":
    from odb.resume.state import STATE_VERSION

    STATES.mkdir(exist_ok=True)
    save(STATE_VERSION)
