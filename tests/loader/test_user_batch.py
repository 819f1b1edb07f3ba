"""The user's batch, read where they wrote it: ``odb.apply`` on a ``DataLoader(batch_size=B)`` and
``ODBDataLoader(batch_size=B, gradient_accumulation_steps=A)`` keep the plain loop's optimizer steps.

The proof, on real gloo ranks (1, 2 and 3 processes through dist_harness; the model wrapped in DDP, which
averages the gradients): after every optimizer step, the float64 parameters equal those of the plain loop
(DistributedSampler + DataLoader(batch_size=B) + A accumulated batches, the step's loss the token mean of
all its ranks' batches), known and online lengths, padded and packed rows; and a state saved inside an
optimizer step resumes to the same parameters. The rank workers live in this module (dist_harness loads
them as "test_user_batch:<name>").
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import odb
from dist_harness import run_ranks
from helpers import LengthDataset, known_lengths, pad_collate

VOCAB = 50
N = 70  # no multiple of any step below: the last step of every run is partial
LENGTHS = known_lengths(N, 2, 40, seed=11)
BUDGET = 96  # a few samples per micro-batch: a step needs several
EXACT = 1e-9


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 6), torch.nn.Linear(6, VOCAB)).double()


def _token_loss(model: torch.nn.Module, batch: Dict[str, Any], reduction: str = "mean") -> torch.Tensor:
    logits = model(batch["input_ids"])[:, :-1]
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100,
                                             reduction=reduction)


def _sampler(ds: Any, rank: int, world: int) -> DistributedSampler:
    return DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=5)


def _plain_params(world: int, batch: int, accumulation: int) -> List[List[torch.Tensor]]:
    """The plain loop's parameters after each optimizer step (every rank's batches computed here)."""
    ds = LengthDataset(LENGTHS)
    per_rank = [list(DataLoader(ds, batch_size=batch, sampler=_sampler(ds, r, world), collate_fn=pad_collate))
                for r in range(world)]
    model, out = _model(), []
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for k in range(-(-len(per_rank[0]) // accumulation)):
        batches = [b for r in range(world) for b in per_rank[r][k * accumulation:(k + 1) * accumulation]]
        total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        opt.zero_grad()
        (sum(_token_loss(model, b, "sum") for b in batches) / total).backward()
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def _loader(rank: int, world: int, c: Dict[str, Any]) -> Any:
    ds = LengthDataset(LENGTHS)
    collate = odb.PackedCollate(backend="torch") if c["layout"] == "packed" else pad_collate
    options = dict(token_budget=BUDGET, layout=c["layout"], shift_labels=True, seed=0,
                   lengths=LENGTHS if c["known"] else None, gradient_accumulation_steps=c["accumulation"])
    if c["via"] == "apply":
        plain = DataLoader(ds, batch_size=c["batch"], sampler=_sampler(ds, rank, world), collate_fn=collate)
        odb.apply(plain, **options)
        return plain
    return odb.ODBDataLoader(ds, batch_size=c["batch"], sampler=_sampler(ds, rank, world), collate_fn=collate,
                             **options)


def _relative(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b)) / max(float(y.abs().max()) for y in b)


def train_like_the_plain_loop(rank: int, world: int, p: Dict[str, Any]) -> List[Dict[str, Any]]:
    """For each case: DDP training on odb's micro-batches, stepping at ``is_last_micro_step``; the largest
    relative parameter difference from the plain loop over all steps, the steps and micro-batch counts.
    With ``resume_at``, the loader is saved after the first micro-batch from that many on that does not end
    its step (inside a step), and a fresh one resumes from the state."""
    results = []
    for c in p["cases"]:
        ref = _plain_params(world, c["batch"], c["accumulation"])
        model = torch.nn.parallel.DistributedDataParallel(_model()) if world > 1 else _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        loader = _loader(rank, world, c)
        steps, micro, worst, seen = 0, [], 0.0, 0
        count, resumed = 0, False
        iterator = iter(loader)
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                break
            info = odb.pop_step_info(batch)
            count += 1
            last = info.is_last_micro_step
            sync = model.no_sync() if world > 1 and not last else _nothing()
            with sync:
                (_token_loss(model, batch) * info.loss_scale).backward()
            seen += info.all_samples_this_step  # this micro-batch's samples, all ranks together
            if last:
                opt.step()
                opt.zero_grad()
                worst = max(worst, _relative([q.detach() for q in model.parameters()], ref[steps]))
                micro.append(info.micro_steps)
                steps += 1
            if not resumed and c.get("resume_at", count + 1) <= count and not last:  # the first point inside a step
                resumed = True  # (every rank runs the same micro-steps, so every rank saves at the same batch)
                state = loader.state_dict()
                del iterator
                loader = _loader(rank, world, c)
                loader.load_state_dict(state)
                iterator = iter(loader)
        results.append({"worst": worst, "steps": steps, "plain_steps": len(ref), "micro": micro, "seen": seen,
                        "cfg": (loader.odb_config.global_batch_size, loader.odb_config.gradient_accumulation_steps)})
    return results


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _cases(world: int) -> List[Dict[str, Any]]:
    full = [dict(via=v, known=k, layout=lay, batch=3, accumulation=a)
            for v in ("apply", "batch_size") for k in (False, True) for lay in ("padded", "packed")
            for a in ((1, 4) if lay == "padded" else (2,))]
    if world == 2:
        return full + [dict(via=v, known=False, layout="padded", batch=3, accumulation=4, resume_at=5)
                       for v in ("apply", "batch_size")]
    return [c for c in full if (c["known"], c["layout"]) in ((False, "padded"), (True, "packed"))]


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_users_batch_gives_the_plain_loops_parameters_after_every_step(tmp_path, world):
    cases = _cases(world)
    results = run_ranks("test_user_batch:train_like_the_plain_loop", world, {"cases": cases}, tmp_path,
                        deadline_s=240)
    for c, *per_rank in zip(cases, *results):
        for out in per_rank:
            assert out["steps"] == out["plain_steps"], (c, out)  # the plain loop's optimizer steps, one for one
            assert out["worst"] < EXACT, (c, out)
            assert out["cfg"] == (c["batch"] * c["accumulation"] * world, 1), (c, out)
            # every sample of the DistributedSampler's shares (it pads them to equal length), once
            assert out["seen"] == -(-N // world) * world or "resume_at" in c, (c, out)
    # the micro-batches vary with the samples' lengths (else this would not show dynamic micro-steps)
    assert len({m for out in results[0] for m in out["micro"]}) > 1


def test_odb_apply_keeps_the_loaders_batch_and_says_so(caplog):
    ds = LengthDataset(LENGTHS)
    plain = DataLoader(ds, batch_size=4, collate_fn=pad_collate)
    with caplog.at_level(logging.INFO, logger="odb"):
        odb.apply(plain, token_budget=BUDGET, gradient_accumulation_steps=2, shift_labels=True)
    assert "odb.apply keeps your batch: 4 samples per rank (the DataLoader's batch_size) x 2 accumulated x 1 " \
           "ranks = 8 samples per optimizer step" in caplog.text
    steps, ids = [], []
    for info in map(odb.pop_step_info, plain):
        ids += info.sample_ids
        if info.is_last_micro_step:
            steps.append(sorted(ids))
            ids = []
    assert steps == [list(range(k, min(k + 8, N))) for k in range(0, N, 8)]  # the plain loop's steps


def test_budget_filled_steps_are_asked_for_by_name():
    ds = LengthDataset(LENGTHS)
    plain = DataLoader(ds, batch_size=4, collate_fn=pad_collate)
    odb.apply(plain, token_budget=BUDGET, global_batch_size=None, shift_labels=True)
    assert plain.odb_config.global_batch_size is None
    left_out = odb.ODBDataLoader(ds, token_budget=BUDGET, collate_fn=pad_collate, shift_labels=True)
    assert left_out.odb_config.global_batch_size is None  # batch_size left out: today's budget-filled steps
    mine = odb.ODBDataLoader(ds, token_budget=BUDGET, batch_size=4, gradient_accumulation_steps=3,
                             collate_fn=pad_collate, shift_labels=True)
    assert (mine.odb_config.global_batch_size, mine.odb_config.gradient_accumulation_steps) == (12, 1)


@pytest.mark.parametrize("make, match", [
    (lambda ds: odb.ODBDataLoader(ds, token_budget=BUDGET, batch_size=4, global_batch_size=64),
     r"global_batch_size=64 and a batch of 4 samples per rank \(ODBDataLoader\(batch_size=\.\.\.\)\) x 1 "
     r"accumulated x 1 ranks = 4: two different optimizer steps.*Fix: drop global_batch_size"),
    (lambda ds: odb.apply(DataLoader(ds, batch_size=4), token_budget=BUDGET, global_batch_size=6),
     r"global_batch_size=6 and a batch of 4 samples per rank \(the DataLoader's batch_size\)"),
    (lambda ds: odb.ODBDataLoader(ds, token_budget=BUDGET, batch_size=0),
     r"batch_size=0 .*an int >= 1.*Fix: pass your batch size"),
    (lambda ds: odb.ODBDataLoader(ds, token_budget=BUDGET, batch_sampler=[[0, 1]]),
     r"batch_sampler=\[\[0, 1\]\].*Fix: drop batch_sampler and pass its sampler and batch size"),
])
def test_conflicting_settings_are_refused_with_the_fix(make, match):
    with pytest.raises(ValueError, match=match):
        make(LengthDataset(LENGTHS))


def test_a_global_batch_size_that_matches_the_users_batch_is_accepted():
    ds = LengthDataset(LENGTHS)
    loader = odb.ODBDataLoader(ds, token_budget=BUDGET, batch_size=4, global_batch_size=4, collate_fn=pad_collate)
    assert loader.odb_config.global_batch_size == 4
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2: must be 1 with global_batch_size=8.*Fix"):
        odb.ODBDataLoader(ds, token_budget=BUDGET, batch_size=4, global_batch_size=8, gradient_accumulation_steps=2)
