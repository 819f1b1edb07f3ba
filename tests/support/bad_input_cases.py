"""The bad-input matrix's cases: datasets with one kind of bad input each, and one rank's run of a real odb loader
over them (``run_case``), shared by the thread-rank tests (tests/loader/test_bad_input.py) and their gloo worker
(``gloo_case``).

A case is a name; a mode is (layout, source, plan): layout "padded" or "packed"; source "known" (``lengths=``),
"online" (map-style, measured in the workers) or "streamed" (an IterableDataset, each rank its own share); plan
"filled" (budget-filled steps), "rank" or "global" (``global_batch_size``, with that ``step_plan``). A run returns
either what every batch held (its samples, its tokens, its step info) or the exception the rank raised, as plain
data (it crosses processes).
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.utils.data import Dataset, IterableDataset

import odb

IGNORE = -100
N = 24
BUDGET = 64
GLOBAL_BATCH = 6  # a multiple of 1, 2 and 3 ranks
EPOCHS = 2
BASE = [3 + (7 * i) % 18 for i in range(N)]  # 3..20 tokens: several samples per micro-batch
STALE = 5  # the sample whose declared length goes stale

CASES = ("empty_one", "empty_share", "empty_step", "masked_one", "masked_step", "stale_over", "stale_under",
         "augment", "oversize", "none_sample", "no_input_ids", "raises_once")


class Spec:
    """One case: each sample's real length per epoch, what is declared (``lengths=`` or a length column), which
    samples are broken, and what the run must do ("train", or "raise" naming ``names``)."""

    def __init__(self, case: str, world: int, source: str) -> None:
        self.real = [list(BASE) for _ in range(EPOCHS)]
        self.declared: Optional[List[int]] = None  # None: odb measures every sample
        self.masked: Sequence[int] = ()
        self.broken: Dict[int, str] = {}
        self.expect, self.names = "train", ""
        share = GLOBAL_BATCH // world
        if case == "empty_one":
            self._set(7, 0)
        elif case == "empty_share":  # rank 0's whole share of the first step (the sampler deals i, i + W, ...)
            for k in range(share):
                self._set(k * world, 0)
        elif case == "empty_step":  # every rank's share of the first step
            for k in range(GLOBAL_BATCH):
                self._set(k, 0)
        elif case == "masked_one":
            self.masked = (4,)
        elif case == "masked_step":
            self.masked = tuple(range(GLOBAL_BATCH))
        elif case == "stale_over":  # declared 3 tokens, loads 40: odb must refuse, not plan a batch over the budget
            self.declared = list(BASE)
            self._set(STALE, 40)
            self.declared[STALE] = 3
            self.expect, self.names = "raise", f"sample {STALE}" if source != "streamed" else "a sample of the stream"
        elif case == "stale_under":  # declared 40, loads 3: budget wasted, reported
            self.declared = list(BASE)
            self.declared[STALE] = 40
            self._set(STALE, 3)
        elif case == "augment":  # sample 9 grows in the second epoch (augmentation)
            self.real[1][9] = 30
            if source == "known":
                self.declared = list(BASE)
                self.expect, self.names = "raise", "sample 9"
        elif case == "oversize":
            self._set(11, BUDGET + 20)
            self.expect, self.names = "raise", "11" if source != "streamed" else ""
        elif case == "none_sample":
            self.broken = {13: case}
            self.expect, self.names = "raise", "13" if source != "streamed" else ""
        elif case == "no_input_ids":  # with lengths= such a record is the collate's to read (it may tokenize):
            self.broken = {13: case}  # this collate pads input_ids, so it fails on it, naming the key
            self.expect, self.names = "raise", "13" if source == "online" else ("input_ids" if source == "known" else "")
        elif case == "raises_once":
            self.broken = {6: case}
            self.expect, self.names = "raise", "sample 6"
        else:
            raise ValueError(f"unknown case {case!r}")
        if self.declared is None and source == "known":
            self.declared = [self.real[0][i] for i in range(N)]

    def _set(self, index: int, length: int) -> None:
        for lengths in self.real:
            lengths[index] = length


def make_sample(index: int, length: int, masked: bool, declared: Optional[int]) -> Dict[str, Any]:
    ids = (torch.arange(length, dtype=torch.long) * 7 + index) % 50
    labels = torch.full_like(ids, IGNORE) if masked else ids.clone()
    sample = {"input_ids": ids, "labels": labels, "idx": index}
    if declared is not None:
        sample["length"] = declared  # a stored length column, read by a length_fn
    return sample


class _Samples:
    """Sample ``index`` of the current epoch (``epoch`` is set by the run), broken as the spec says."""

    def __init__(self, spec: Spec) -> None:
        self.spec, self.epoch, self.raised = spec, 0, False

    def load(self, index: int) -> Any:
        kind = self.spec.broken.get(index)
        if kind == "none_sample":
            return None
        if kind == "raises_once" and not self.raised:
            self.raised = True
            raise OSError(f"reading sample {index} failed (a flaky disk; it reads on a retry)")
        sample = make_sample(index, self.spec.real[self.epoch][index], index in self.spec.masked,
                             None if self.spec.declared is None else self.spec.declared[index])
        if kind == "no_input_ids":
            sample["tokens"] = sample.pop("input_ids")
        return sample


class MapData(Dataset):
    def __init__(self, samples: _Samples) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> Any:
        return self.samples.load(int(index))


class StreamData(IterableDataset):
    """Rank ``rank`` of ``world`` streams samples rank, rank + world, ..."""

    def __init__(self, samples: _Samples, rank: int, world: int) -> None:
        self.samples, self.rank, self.world = samples, rank, world

    def __iter__(self):
        for index in range(self.rank, N, self.world):
            yield self.samples.load(index)


def pad_collate(samples: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A padding collator; like transformers' (``tokenizer.pad``) it refuses a record without input_ids."""
    for s in samples:
        if "input_ids" not in s:
            raise ValueError(f"pad_collate: a sample with fields {sorted(s)} has no 'input_ids' to pad. Fix: "
                             f"tokenize every sample.")
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, :len(s["input_ids"])] = s["input_ids"]
        labels[row, :len(s["labels"])] = s["labels"]
    return {"input_ids": ids, "labels": labels, "idx": [s["idx"] for s in samples]}


class PackedWithIds:
    """odb.PackedCollate's row, plus the samples' indices."""

    def __init__(self) -> None:
        self.packed = odb.PackedCollate(backend="torch")

    def __call__(self, samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        return {**self.packed(samples), "idx": [s["idx"] for s in samples]}


def loader_for(rank: int, world: int, exchange: Any, case: str, layout: str, source: str, plan: str,
               samples: _Samples) -> odb.ODBDataLoader:
    spec = samples.spec
    options: Dict[str, Any] = dict(token_budget=BUDGET, layout=layout, shift_labels=True, seed=0,
                                   collate_fn=PackedWithIds() if layout == "packed" else pad_collate)
    if plan != "filled":
        options.update(global_batch_size=GLOBAL_BATCH, step_plan=plan)
    if exchange is not None:
        options["exchange"] = exchange
    if source == "streamed":
        dataset: Any = StreamData(samples, rank, world)
    else:
        dataset = MapData(samples)
        options["sampler"] = odb.ShardSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    if source == "known":
        options["lengths"] = spec.declared
    elif spec.declared is not None:  # online and streamed: the declared lengths are a stored column
        options["length_fn"] = lambda s: s["length"] if isinstance(s, dict) and "length" in s else len(s["input_ids"])
    return odb.ODBDataLoader(dataset, **options)


def run_case(rank: int, world: int, exchange: Any, case: str, layout: str, source: str, plan: str) -> Dict[str, Any]:
    """One rank's run of ``case`` in a mode: ``{"batches": [[(ids, tokens, info fields)], per epoch], "stats"}``,
    or ``{"error": (type name, message, traceback), "seconds": from the loader's first next()}``."""
    samples = _Samples(Spec(case, world, source))
    started = time.monotonic()
    try:
        loader = loader_for(rank, world, exchange, case, layout, source, plan, samples)
        epochs = []
        for epoch in range(EPOCHS):
            samples.epoch = epoch
            loader.set_epoch(epoch)
            started = time.monotonic()
            batches = []
            for batch in loader:
                info = odb.pop_step_info(batch)
                rows, width = batch["input_ids"].shape
                batches.append({"ids": [] if info.is_ghost else list(batch["idx"]), "tokens": rows * width,
                                "ghost": info.is_ghost, "scale": info.loss_scale, "last": info.is_last_micro_step,
                                "samples": info.all_samples_this_step})
            epochs.append(batches)
        return {"batches": epochs, "stats": dict(loader.odb_stats)}
    except Exception as err:  # the test reads it
        return {"error": (type(err).__name__, str(err), traceback.format_exc()),
                "seconds": time.monotonic() - started}


def gloo_case(rank: int, world: int, params: Dict[str, Any]) -> Dict[str, Any]:
    """The gloo worker (tests/support/dist_harness.py): ``run_case`` on torch.distributed's default group."""
    return run_case(rank, world, None, params["case"], params["layout"], params["source"], params["plan"])
