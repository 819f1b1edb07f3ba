"""Step composition: which samples form each optimizer step (``composition``), one class per strategy, pure.

With the user's batch (``global_batch_size``) every rank reads its share of each optimizer step from its
sampler's order. A composition reads a *block* of ``block_steps`` steps' shares at a time and says which of
the block's samples each step holds and in which order the steps come (``compose``); the loader then plans
each step's micro-batches (per rank or across ranks) as it always does. Every rank composes its own block
with the same rule and the same random draws (seeded by the run's seed, the epoch and the block), so the
k-th step of every rank is made of alike samples.

* ``"sampler"`` (default, ``SamplerOrder``): the sampler's order, one step's share at a time: the steps the
  user's own loader gives (any sampler: random, sequential, transformers' ``LengthGroupedSampler``).
* ``"length_grouped"`` (``LengthGrouped``): each step made of length-similar samples of a block, the block's
  steps in a shuffled order, so that adjacent steps' lengths do not follow each other; an optional
  short-to-long warm-up over the first steps of the run.

A new composition is one module of this package with a class that has ``block_steps`` and ``compose``, and
one name in ``COMPOSITIONS`` (``register_composition``), which ``ODBConfig.composition`` accepts.

Example:
    >>> import numpy as np
    >>> comp = make_composition("length_grouped", block_steps=2)
    >>> steps = comp.compose(np.array([[5], [40], [6], [41]]), 2, seed=0, epoch=0, block=0, first_step=0)
    >>> sorted(sorted(s.tolist()) for s in steps)   # the two short samples share a step, the two long ones
    [[0, 2], [1, 3]]
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Protocol

import numpy as np

from odb.plan.steps.composition.length_grouped import LengthGrouped, adjacent_correlation
from odb.plan.steps.composition.sampler_order import SamplerOrder

__all__ = ["COMPOSITIONS", "Composition", "LengthGrouped", "SamplerOrder", "adjacent_correlation",
           "make_composition", "register_composition"]


class Composition(Protocol):
    """One step composition (see the module docstring)."""

    block_steps: int  # optimizer steps' shares read and composed together (1: no read-ahead)

    def compose(self, lengths: np.ndarray, step_samples: int, *, seed: int, epoch: int, block: int,
                first_step: int) -> List[np.ndarray]:
        """The block's steps in the order they run: each an array of indices into the block's samples
        (``lengths``: (n, D), in the sampler's order), every index once; every step holds ``step_samples``
        of them, except the last of a block that ends the data, which holds the rest. ``first_step``: the
        optimizer steps of the epoch before the block; ``block``: the blocks before it."""


# name -> factory(**settings): the values of ODBConfig.composition
COMPOSITIONS: Dict[str, Callable[..., Composition]] = {"sampler": SamplerOrder, "length_grouped": LengthGrouped}


def register_composition(name: str, factory: Callable[..., Composition]) -> None:
    """Make ``composition=name`` compose steps by ``factory(block_steps=..., warmup_steps=...)``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_composition got name={name!r}: must be a non-empty str. Fix: pass e.g. "
                         f"'curriculum'.")
    COMPOSITIONS[name] = factory


def make_composition(name: str, **settings: Any) -> Composition:
    """The composition ``name`` names, with its settings (``block_steps``, ``warmup_steps``)."""
    if name not in COMPOSITIONS:
        raise ValueError(f"composition={name!r} names no step composition ({sorted(COMPOSITIONS)}). Fix: use one "
                         f"of them, or odb.plan.steps.composition.register_composition({name!r}, factory) first.")
    return COMPOSITIONS[name](**settings)
