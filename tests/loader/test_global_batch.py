"""global_batch_size: odb keeps the user's optimizer steps and only makes their micro-batches dynamic.

The proof: in float64, after K optimizer steps the parameters equal those of a plain DataLoader loop
with the same sampler, ``batch_size x accumulation`` samples per rank and step, and the token mean of
the whole optimizer step as its loss (HF's ``num_items_in_batch`` rule): 1 and 2 ranks (ranks as
threads exchanging through odb.comm.threads; the DDP mean of the gradients taken by hand), accumulation
1 and 4, padded and packed rows, lengths known up front or measured online.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import odb
from helpers import IGNORE, LengthDataset, known_lengths, pad_collate
from test_thread_ranks import ok, run_ranks

VOCAB = 50
N = 70  # not a multiple of any global batch below: every run ends with a partial step
LENGTHS = known_lengths(N, 2, 40, seed=11)
BUDGET = 96  # a few samples per micro-batch: each optimizer step needs several


def model_of(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 6), torch.nn.Linear(6, VOCAB)).double()


def token_loss(model: torch.nn.Module, batch: Dict[str, Any], reduction: str = "mean") -> torch.Tensor:
    """A causal LM's loss: logits at t predict labels at t + 1 (packed rows mask each sample's first label)."""
    logits = model(batch["input_ids"])[:, :-1]
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE,
                                             reduction=reduction)


def sampler_of(ds: Any, rank: int, world: int) -> odb.ShardSampler:
    return odb.ShardSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=5)


def reference(world: int, batch_size: int, accumulation: int, steps: int,
              drop_last: bool = False) -> Tuple[List[List[int]], List[torch.Tensor]]:
    """A plain loop: every rank's DataLoader(batch_size) over its shard, ``accumulation`` batches per step,
    the loss of a step the token mean over all its ranks' batches. Each step's samples, and the parameters."""
    ds = LengthDataset(LENGTHS)
    per_rank = [list(DataLoader(ds, batch_size=batch_size, sampler=sampler_of(ds, r, world), collate_fn=pad_collate,
                                drop_last=drop_last)) for r in range(world)]
    model = model_of()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step_ids = []
    for k in range(steps):
        batches = [b for r in range(world) for b in per_rank[r][k * accumulation:(k + 1) * accumulation]]
        total = sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in batches)
        opt.zero_grad()
        loss = sum(token_loss(model, b, "sum") for b in batches) / total
        loss.backward()
        opt.step()
        step_ids.append(sorted(i for b in batches for i in b["idx"]))
    return step_ids, [p.detach().clone() for p in model.parameters()]


def collate_for(layout: str) -> Any:
    return odb.PackedCollate(backend="torch") if layout == "packed" else pad_collate


def odb_batches(world: int, global_batch: int, layout: str = "padded", known: bool = False,
                **options: Any) -> List[List[Tuple[Dict[str, Any], odb.ODBStepInfo]]]:
    """Every rank's (batch, step info) of one epoch of odb with ``global_batch_size``."""
    def one(rank: int, exchanges: Any) -> List[Tuple[Dict[str, Any], odb.ODBStepInfo]]:
        ds = LengthDataset(LENGTHS)
        loader = odb.ODBDataLoader(ds, token_budget=BUDGET, global_batch_size=global_batch, layout=layout,
                                   sampler=sampler_of(ds, rank, world), collate_fn=collate_for(layout), seed=0,
                                   shift_labels=True, lengths=LENGTHS if known else None, exchange=exchanges,
                                   **options)
        out = []
        for batch in loader:
            info = odb.pop_step_info(batch)
            out.append((batch, info))
        return out

    if world == 1:
        return [one(0, None)]
    return ok(run_ranks(world, one))


def ids_of(batch: Dict[str, Any], info: odb.ODBStepInfo) -> List[int]:
    return [] if info.is_ghost else list(info.sample_ids)


def train(per_rank: List[List[Tuple[Dict[str, Any], odb.ODBStepInfo]]]
          ) -> Tuple[List[List[int]], List[torch.Tensor]]:
    """Each optimizer step: every rank's micro-batches, loss x loss_scale, the gradients' mean over ranks (as
    DDP takes it), one SGD step. Each step's samples, and the parameters."""
    world = len(per_rank)
    steps = [split_steps(batches) for batches in per_rank]
    assert len({len(s) for s in steps}) == 1, "ranks ran different numbers of optimizer steps"
    model = model_of()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step_ids = []
    for k in range(len(steps[0])):
        micro = [steps[r][k] for r in range(world)]
        assert len({len(m) for m in micro}) == 1, f"step {k}: ranks ran different numbers of micro-batches"
        opt.zero_grad()
        for rank_micro in micro:
            for batch, info in rank_micro:
                (token_loss(model, batch) * info.loss_scale / world).backward()
        opt.step()
        step_ids.append(sorted(i for m in micro for b, info in m for i in ids_of(b, info)))
    return step_ids, [p.detach().clone() for p in model.parameters()]


def split_steps(batches: List[Tuple[Dict[str, Any], odb.ODBStepInfo]]) -> List[List[Tuple[Any, odb.ODBStepInfo]]]:
    out: List[List[Tuple[Any, odb.ODBStepInfo]]] = [[]]
    for batch, info in batches:
        assert info.micro_step == len(out[-1])
        out[-1].append((batch, info))
        if info.is_last_micro_step:
            out.append([])
    assert out[-1] == [], "an epoch ended inside an optimizer step"
    return out[:-1]


def relative_error(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    num = max(float((x - y).abs().max()) for x, y in zip(a, b))
    return num / max(float(y.abs().max()) for y in b)


@pytest.mark.parametrize("world,step_plan", [(1, "global"), (2, "global"), (3, "global"), (2, "rank")])
@pytest.mark.parametrize("accumulation", [1, 4])
@pytest.mark.parametrize("layout,known", [("padded", False), ("padded", True), ("packed", False), ("packed", True)])
def test_same_updates_as_a_plain_loop(world: int, step_plan: str, accumulation: int, layout: str, known: bool) -> None:
    """Step plans "global" (the default: each step planned across ranks, samples moving between them) and
    "rank" (each rank cuts its own share) both give the plain loop's updates."""
    batch_size = 3
    global_batch = batch_size * accumulation * world
    got = odb_batches(world, global_batch, layout, known, step_plan=step_plan)
    odb_ids, odb_params = train(got)
    steps = -(-N // global_batch)
    ref_ids, ref_params = reference(world, batch_size, accumulation, steps)
    assert odb_ids == ref_ids  # optimizer step k holds exactly the plain loop's samples of step k
    assert relative_error(odb_params, ref_params) < 1e-9
    infos = [info for rank in got for _, info in rank]
    assert all(info.padded_tokens <= BUDGET for info in infos if info.local_samples > 1)
    # the micro-batches vary with the samples' lengths (else this test would not show dynamic micro-batches)
    assert len({(info.micro_steps, info.local_samples) for info in infos}) > 1


def test_every_step_holds_global_batch_size_samples_and_len_counts_optimizer_steps() -> None:
    got = odb_batches(2, 12)
    counts = [sum(info.local_samples for rank in got for _, info in rank if info.micro_batch in steps)
              for steps in _step_members(got[0])]
    assert counts == [12] * (N // 12) + [N % 12]
    ds = LengthDataset(LENGTHS)
    loader = odb.ODBDataLoader(ds, token_budget=BUDGET, global_batch_size=12, collate_fn=pad_collate,
                               sampler=sampler_of(ds, 0, 2), exchange=odb.comm.threads.ThreadRanks(2).exchanges(0))
    assert loader.odb_optimizer_steps == -(-N // 12)
    loader = odb.ODBDataLoader(ds, token_budget=BUDGET, global_batch_size=12, collate_fn=pad_collate, drop_last=True,
                               shift_labels=True)
    assert loader.odb_optimizer_steps == N // 12
    steps = split_steps([(b, odb.pop_step_info(b)) for b in loader])
    assert [sum(i.local_samples for _, i in s) for s in steps] == [12] * (N // 12)
    assert loader.odb_stats["dropped_samples"] == N % 12


def _step_members(batches: List[Tuple[Any, odb.ODBStepInfo]]) -> List[set]:
    return [{info.micro_batch for _, info in step} for step in split_steps(batches)]


@pytest.mark.filterwarnings("ignore:.*does not shard the dataset")  # each rank's list of indices is its shard
@pytest.mark.parametrize("step_plan", ["rank", "global"])
def test_uneven_ranks_run_the_same_micro_steps_with_ghosts(step_plan: str) -> None:
    """Ranks whose shares differ (one runs out first) still run equal micro-steps per optimizer step, and the
    gradient stays the exact token mean. Per-rank plans: the short rank's last steps are ghosts. Global plans:
    each step holds both ranks' next 4 samples, dealt to whichever rank balances the step."""
    world, g = 2, 8
    shards = [list(range(0, 40)), list(range(40, 52))]  # rank 1 has 12 samples: steps 3-9 have none of its own

    def one(rank: int, exchanges: Any) -> List[Tuple[Dict[str, Any], odb.ODBStepInfo]]:
        ds = LengthDataset(LENGTHS)
        loader = odb.ODBDataLoader(ds, token_budget=BUDGET, global_batch_size=g, sampler=shards[rank],
                                   collate_fn=pad_collate, seed=0, shift_labels=True, exchange=exchanges,
                                   step_plan=step_plan)
        return [(b, odb.pop_step_info(b)) for b in loader]

    got = ok(run_ranks(world, one))
    steps = [split_steps(r) for r in got]
    assert len(steps[0]) == len(steps[1]) == 10
    for k in range(10):
        assert len(steps[0][k]) == len(steps[1][k])
        held = [sorted(i for _, info in steps[r][k] for i in ids_of(None, info)) for r in range(world)]
        if step_plan == "rank":
            assert held[0] == shards[0][4 * k:4 * k + 4]
            assert held[1] == shards[1][4 * k:4 * k + 4]
        else:
            assert sorted(held[0] + held[1]) == sorted(shards[0][4 * k:4 * k + 4] + shards[1][4 * k:4 * k + 4])
    if step_plan == "rank":
        assert any(info.is_ghost for step in steps[1] for _, info in step)
    else:  # rank 1's own data ends at step 3, yet it trains on rank 0's samples after that
        assert sum(info.local_samples for step in steps[1][3:] for _, info in step) > 0
    odb_ids, odb_params = train(got)
    model = model_of()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ds = LengthDataset(LENGTHS)
    for k, ids in enumerate(odb_ids):
        assert ids == sorted(shards[0][4 * k:4 * k + 4] + shards[1][4 * k:4 * k + 4])
        batch = pad_collate([ds[i] for i in ids])
        opt.zero_grad()
        token_loss(model, batch).backward()
        opt.step()
    assert relative_error(odb_params, [p.detach() for p in model.parameters()]) < 1e-9


def test_resume_mid_step_and_between_steps() -> None:
    """A state saved inside an optimizer step or between two resumes with exactly the batches not yet
    emitted, with the same loss scales."""
    ds = LengthDataset(LENGTHS)

    def loader() -> odb.ODBDataLoader:
        return odb.ODBDataLoader(ds, token_budget=BUDGET, global_batch_size=9, collate_fn=pad_collate, seed=1,
                                 shuffle=True, shift_labels=True)

    full = [odb.pop_step_info(b) for b in loader()]
    cuts = [k for k, info in enumerate(full) if 0 < info.micro_step][:1] + \
        [k + 1 for k, info in enumerate(full) if info.is_last_micro_step][:1]
    assert len(cuts) == 2
    for cut in cuts:
        first = loader()
        it = iter(first)
        for _ in range(cut):
            odb.pop_step_info(next(it))
        state = json.loads(json.dumps(first.state_dict()))
        fresh = loader()
        fresh.load_state_dict(state)
        rest = [odb.pop_step_info(b) for b in fresh]
        key = lambda i: (i.sample_ids, i.micro_step, i.micro_steps, i.loss_scale)  # noqa: E731
        assert [key(i) for i in rest] == [key(i) for i in full[cut:]]


@pytest.mark.parametrize("known", [False, True])
def test_two_ranks_resume_inside_and_between_global_steps(known: bool) -> None:
    """Under step_plan="global" a rank holds other ranks' samples inside a step: states saved there (and between
    steps) resume on 2 ranks with exactly the batches not yet emitted, with the same loss scales."""
    def loader(rank: int, exchanges: Any) -> odb.ODBDataLoader:
        ds = LengthDataset(LENGTHS)
        return odb.ODBDataLoader(ds, token_budget=BUDGET, global_batch_size=12, sampler=sampler_of(ds, rank, 2),
                                 collate_fn=pad_collate, seed=0, shift_labels=True, exchange=exchanges,
                                 lengths=LENGTHS if known else None)

    key = lambda i: (i.sample_ids, i.micro_step, i.micro_steps, i.loss_scale, i.is_ghost)  # noqa: E731
    full = ok(run_ranks(2, lambda rank, ex: [key(odb.pop_step_info(b)) for b in loader(rank, ex)]))
    ends = [k + 1 for k, i in enumerate(full[0]) if i[1] == i[2] - 1]  # after each step's last micro-batch
    assert full[0][ends[1]][2] > 1, "step 2 has one micro-batch: no state inside it"
    inside, between = ends[1] + 1, ends[1]
    foreign = 0
    for cut in (inside, between):
        def first_part(rank: int, ex: Any) -> Dict[str, Any]:
            ld = loader(rank, ex)
            it = iter(ld)
            for _ in range(cut):
                odb.pop_step_info(next(it))
            return json.loads(json.dumps(ld.state_dict()))

        states = ok(run_ranks(2, first_part))
        foreign += sum(1 for st in states for row in st["run"]["position"]["micro"] if row[0]
                       for i in row[0] if i < 0)

        def rest(rank: int, ex: Any) -> List[Any]:
            ld = loader(rank, ex)
            ld.load_state_dict(states[rank])
            return [key(odb.pop_step_info(b)) for b in ld]

        got = ok(run_ranks(2, rest))
        assert got == [full[r][cut:] for r in range(2)]
    assert foreign > 0  # the state inside the step held samples planned here from the other rank


def test_bad_values_are_refused_with_the_rule_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"global_batch_size=0.*Fix"):
        odb.ODBConfig(token_budget=64, global_batch_size=0)
    with pytest.raises(ValueError, match=r"step_plan='ranks'.*\"global\".*Fix"):
        odb.ODBConfig(token_budget=64, global_batch_size=8, step_plan="ranks")
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4.*must be 1 with global_batch_size=32"):
        odb.ODBConfig(token_budget=64, global_batch_size=32, gradient_accumulation_steps=4)
    ds = LengthDataset(LENGTHS)
    ranks = odb.comm.threads.ThreadRanks(2)
    with pytest.raises(ValueError, match=r"global_batch_size=9.*multiple of the world size \(2 ranks\).*Fix"):
        odb.ODBDataLoader(ds, token_budget=BUDGET, global_batch_size=9, collate_fn=pad_collate,
                          sampler=sampler_of(ds, 0, 2), exchange=ranks.exchanges(0))
    with pytest.raises(ValueError, match=r"global_batch_size=1.*multiple of the world size"):
        odb.ODBDataLoader(ds, token_budget=BUDGET, global_batch_size=1, collate_fn=pad_collate,
                          sampler=sampler_of(ds, 0, 2), exchange=ranks.exchanges(0))


def test_auto_budget_schedule_and_balance_keep_the_steps() -> None:
    """token_budget="auto" and a budget schedule move the micro-batches, never the optimizer steps' samples."""
    from odb.train.memory import ActivationMeter

    model = model_of()
    ds = LengthDataset(LENGTHS)
    for options in ({"budget_schedule": ((0, 48), (3, BUDGET))},
                    {"token_budget": "auto", "memory_cap_bytes": 200_000, "memory_meter": ActivationMeter(model)}):
        options = {"token_budget": BUDGET, **options}
        loader = odb.ODBDataLoader(ds, global_batch_size=10, collate_fn=pad_collate, seed=0, shuffle=False,
                                   shift_labels=True, **options)
        infos = []
        for batch in loader:
            info = odb.pop_step_info(batch)
            infos.append(info)
            (token_loss(model, batch) * info.loss_scale).backward()
        steps = split_steps([(None, i) for i in infos])
        assert [sorted(j for _, i in s for j in i.sample_ids) for s in steps] == \
            [list(range(k, min(k + 10, N))) for k in range(0, N, 10)]


@pytest.mark.parametrize("cut_micro", [False, True])
def test_elastic_resume_from_two_ranks_onto_one(cut_micro: bool) -> None:
    """States saved by 2 ranks (between steps or inside one), loaded on 1: every sample exactly once, and the
    resumed run's steps hold global_batch_size samples again."""
    g = 8

    def first_part(rank: int, exchanges: Any) -> Tuple[List[int], Dict[str, Any]]:
        ds = LengthDataset(LENGTHS)
        loader = odb.ODBDataLoader(ds, token_budget=BUDGET, global_batch_size=g, sampler=sampler_of(ds, rank, 2),
                                   collate_fn=pad_collate, seed=0, shift_labels=True, exchange=exchanges)
        seen, steps = [], 0
        for batch in loader:
            info = odb.pop_step_info(batch)
            seen += ids_of(batch, info)
            steps += info.is_last_micro_step
            if steps == 3 and (info.is_last_micro_step or (cut_micro and info.micro_step == 0)):
                if not cut_micro or not info.is_last_micro_step:
                    break
        return seen, json.loads(json.dumps(loader.state_dict()))

    parts = ok(run_ranks(2, first_part))
    ds = LengthDataset(LENGTHS)
    resumed = odb.ODBDataLoader(ds, token_budget=BUDGET, global_batch_size=g, sampler=sampler_of(ds, 0, 1),
                                collate_fn=pad_collate, seed=0, shift_labels=True)
    with pytest.warns(UserWarning, match="inside an optimizer step") if cut_micro else contextlib.nullcontext():
        resumed.load_state_dict([p[1] for p in parts])
    rest = [(b, odb.pop_step_info(b)) for b in resumed]
    before = [i for p in parts for i in p[0]]
    after = [i for b, info in rest for i in ids_of(b, info)]
    assert sorted(before + after) == list(range(N))
    full_steps = [sum(info.local_samples for _, info in s) for s in split_steps(rest)]
    assert all(n == g for n in full_steps[1:-1])


def test_oom_split_keeps_the_steps_exact() -> None:
    """A micro-batch that runs out of memory (simulated: over 2 rows) is split by the OOM fallback; the
    parameters after every step still equal the plain loop's (its model never runs out)."""
    from odb.train.oom import train_step_with_oom_fallback
    from oom_workers import OOMLM, token_mean_loss

    ds = LengthDataset(LENGTHS)
    loader = odb.ODBDataLoader(ds, token_budget=BUDGET, global_batch_size=8, collate_fn=pad_collate, seed=0,
                               shuffle=False, shift_labels=False)
    model = OOMLM(0, 2, "forward")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    steps, ids = [], []
    for batch in loader:
        info = odb.pop_step_info(batch)
        ids += list(info.sample_ids)
        train_step_with_oom_fallback(lambda b: token_mean_loss(model, b), batch, info, model=model,
                                     counters=loader.odb_oom_counters)
        if info.is_last_micro_step:
            opt.step()
            opt.zero_grad()
            steps.append(ids)
            ids = []
    assert loader.odb_stats["oom_split_micro_batches"] > 0
    assert [sorted(s) for s in steps] == [list(range(k, min(k + 8, N))) for k in range(0, N, 8)]
    ref = OOMLM(0, 10**6, "forward")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in steps:
        batch = pad_collate([ds[i] for i in step])
        ref_opt.zero_grad()
        token_mean_loss(ref, batch).backward()  # the step's token mean over all its samples
        ref_opt.step()
    assert relative_error([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()]) < 1e-9


def test_apply_takes_global_batch_size() -> None:
    ds = LengthDataset(LENGTHS)
    plain = DataLoader(ds, batch_size=1, collate_fn=pad_collate)
    odb.apply(plain, token_budget=BUDGET, global_batch_size=10, shift_labels=True)
    steps = split_steps([(b, odb.pop_step_info(b)) for b in plain])
    assert [sorted(j for _, i in s for j in i.sample_ids) for s in steps] == \
        [list(range(k, min(k + 10, N))) for k in range(0, N, 10)]


def test_balance_time_with_auto_on_two_ranks_keeps_the_steps() -> None:
    """balance="time" (the global plan's micro-batches dealt to ranks by predicted seconds once every rank's time
    model is fitted) and token_budget="auto" change which rank runs which micro-batch, never which samples a
    step holds or the update."""
    from odb.train.memory import ActivationMeter

    def one(rank: int, exchanges: Any) -> List[Tuple[Dict[str, Any], odb.ODBStepInfo]]:
        ds = LengthDataset(LENGTHS)
        model = model_of()
        loader = odb.ODBDataLoader(ds, token_budget="auto", memory_cap_bytes=200_000, auto_start_budget=BUDGET,
                                   memory_meter=ActivationMeter(model), balance="time", global_batch_size=8,
                                   sampler=sampler_of(ds, rank, 2), collate_fn=pad_collate, seed=0,
                                   shift_labels=True, exchange=exchanges)
        out = []
        for batch in loader:
            info = odb.pop_step_info(batch)
            (token_loss(model, batch) * info.loss_scale).backward()
            out.append((batch, info))
        return out, loader.odb_stats["price_dealt_steps"]

    got = ok(run_ranks(2, one))
    odb_ids, odb_params = train([batches for batches, _ in got])
    ref_ids, ref_params = reference(2, 4, 1, -(-N // 8))
    assert odb_ids == ref_ids
    assert relative_error(odb_params, ref_params) < 1e-9
    # once every rank's time model predicts, the global plan's micro-batches are dealt by predicted seconds
    dealt = [n for _, n in got]
    assert dealt[0] == dealt[1] > 0


class RankStream(torch.utils.data.IterableDataset):
    """A stream sharded by rank (as HF streaming datasets' split_dataset_by_node): rank r of W yields samples
    r, r + W, ... (uneven: N is not a multiple of W)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def __iter__(self):
        ds = LengthDataset(LENGTHS)
        for i in range(self.rank, N, self.world):
            yield ds[i]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_stream_planned_across_ranks_gives_the_plain_loops_updates_for_two_epochs(layout: str) -> None:
    """Rank-sharded streams (no lengths up front): each step's samples move between ranks as the global plan
    deals them; over two epochs every step holds the plain loop's samples and the parameters match it."""
    world, g = 3, 9

    def one(rank: int, exchanges: Any) -> List[List[Tuple[Dict[str, Any], odb.ODBStepInfo]]]:
        loader = odb.ODBDataLoader(RankStream(rank, world), token_budget=BUDGET, global_batch_size=g,
                                   collate_fn=collate_for(layout), layout=layout, seed=0, shift_labels=True,
                                   exchange=exchanges)
        return [[(b, odb.pop_step_info(b)) for b in loader] for _ in range(2)]

    got = ok(run_ranks(world, one))
    moved = 0
    for epoch in range(2):
        per_rank = [got[r][epoch] for r in range(world)]
        _, odb_params = train(per_rank)  # (a stream's sample_ids are positions in each rank's own stream)
        shares = [list(range(r, N, world)) for r in range(world)]
        want = [sorted(i for r in range(world) for i in shares[r][k * 3:(k + 1) * 3])
                for k in range(-(-max(len(s) for s in shares) // 3))]
        if layout == "padded":  # padded batches carry their samples' "idx" (packed rows do not: their updates show)
            held = [[[int(i) for b, info in step if not info.is_ghost for i in b["idx"]] for step in split_steps(r)]
                    for r in per_rank]
            assert [sorted(i for r in range(world) for i in held[r][k]) for k in range(len(want))] == want
            moved += sum(1 for r in range(world) for step in held[r] for i in step if i % world != r)
        model = model_of()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        ds = LengthDataset(LENGTHS)
        for ids in want:
            batch = pad_collate([ds[i] for i in ids])
            opt.zero_grad()
            token_loss(model, batch).backward()
            opt.step()
        assert relative_error(odb_params, [p.detach() for p in model.parameters()]) < 1e-9
    assert moved > 0 or layout == "packed"  # samples did cross ranks


@pytest.mark.parametrize("world,step_plan,known", [(1, "global", False), (2, "global", False), (3, "global", True),
                                                   (3, "global", False), (2, "rank", False)])
@pytest.mark.parametrize("how", ["batch_size", "apply"])
def test_drop_last_drops_only_each_ranks_partial_batch_as_a_plain_loop(world: int, step_plan: str, known: bool,
                                                                       how: str) -> None:
    """drop_last with your batch B and accumulation A: each rank drops only its last partial batch of B and the
    last optimizer step holds the whole batches left (fewer than A of them), as the Trainer, Accelerate and a
    plain loop that steps at the epoch's end do; before, odb dropped that whole partial step."""
    batch_size, accumulation = 3, 4

    def one(rank: int, exchanges: Any) -> List[Tuple[Dict[str, Any], odb.ODBStepInfo]]:
        ds = LengthDataset(LENGTHS)
        options = dict(token_budget=BUDGET, gradient_accumulation_steps=accumulation, seed=0, shift_labels=True,
                       lengths=LENGTHS if known else None, exchange=exchanges, step_plan=step_plan)
        if how == "apply":
            loader = DataLoader(ds, batch_size=batch_size, sampler=sampler_of(ds, rank, world), collate_fn=pad_collate,
                                drop_last=True)
            odb.apply(loader, **options)
        else:
            loader = odb.ODBDataLoader(ds, batch_size=batch_size, sampler=sampler_of(ds, rank, world),
                                       collate_fn=pad_collate, drop_last=True, **options)
        out = [(b, odb.pop_step_info(b)) for b in loader]
        assert loader.odb_optimizer_steps == len(split_steps(out))
        return out

    got = [one(0, None)] if world == 1 else ok(run_ranks(world, one))
    odb_ids, odb_params = train(got)
    ds = LengthDataset(LENGTHS)
    shares = [len(sampler_of(ds, r, world)) for r in range(world)]
    steps = max(-(-(n // batch_size) // accumulation) for n in shares)
    ref_ids, ref_params = reference(world, batch_size, accumulation, steps, drop_last=True)
    assert odb_ids == ref_ids
    assert sum(map(len, odb_ids)) == sum(n - n % batch_size for n in shares)  # only the partial batches dropped
    assert len(odb_ids[-1]) < batch_size * accumulation * world  # the last step is partial: this test shows it
    assert relative_error(odb_params, ref_params) < 1e-9


@pytest.mark.parametrize("known", [False, True])
def test_the_move_is_counted_where_samples_cross_ranks(known: bool) -> None:
    """odb_stats says what moving cost each rank: samples and pickled bytes sent, seconds spent; with known
    lengths a sample is its dataset index and nothing is sent."""
    def one(rank: int, exchanges: Any) -> Dict[str, Any]:
        ds = LengthDataset(LENGTHS)
        loader = odb.ODBDataLoader(ds, token_budget=BUDGET, global_batch_size=12, sampler=sampler_of(ds, rank, 2),
                                   collate_fn=pad_collate, seed=0, shift_labels=True,
                                   lengths=LENGTHS if known else None, exchange=exchanges)
        seen = sum(odb.pop_step_info(b).local_samples for b in loader)
        return dict(loader.odb_stats, seen=seen)

    stats = ok(run_ranks(2, one))
    assert sum(s["seen"] for s in stats) == N
    moved = [s["moved_samples"] for s in stats]
    if known:
        assert moved == [0, 0] and all(s["moved_bytes"] == 0 for s in stats)
    else:
        assert sum(moved) > 0
        assert all(s["moved_bytes"] > 0 and s["move_s"] > 0 for s, m in zip(stats, moved) if m)


class CorpusSlices(torch.utils.data.Dataset):
    """Samples cut from one large token tensor (as a memory-mapped corpus gives them): each is a view of it."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = list(lengths)
        self.offsets = np.concatenate(([0], np.cumsum(self.lengths)[:-1]))
        self.corpus = torch.arange(int(sum(self.lengths)) + 200_000) % 97 + 3  # 200k tokens no sample holds

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        start = int(self.offsets[index])
        ids = self.corpus[start:start + self.lengths[index]]
        return {"input_ids": ids, "labels": ids, "idx": index, "pid": 0, "tag": None}


def test_a_moved_sample_sends_its_own_tokens_not_the_corpus_it_is_cut_from() -> None:
    """pickle writes a tensor view with its whole storage: a sample cut from a corpus tensor would send the
    corpus. The move sends each sample's own elements, and the receiver trains on the same tokens."""
    def one(rank: int, exchanges: Any) -> Dict[str, Any]:
        ds = CorpusSlices(LENGTHS)
        loader = odb.ODBDataLoader(ds, token_budget=BUDGET, global_batch_size=12, sampler=sampler_of(ds, rank, 2),
                                   collate_fn=pad_collate, seed=0, shift_labels=True, exchange=exchanges)
        rows = []
        for batch in loader:
            odb.pop_step_info(batch)
            for i, row in zip(batch["idx"], batch["input_ids"]):
                rows.append((i, row[:LENGTHS[i]].tolist() == ds[i]["input_ids"].tolist()))
        return dict(loader.odb_stats, rows=rows)

    stats = ok(run_ranks(2, one))
    assert sum(len(s["rows"]) for s in stats) == N and all(same for s in stats for _, same in s["rows"])
    moved = sum(s["moved_samples"] for s in stats)
    assert moved > 0
    corpus_bytes = 8 * (sum(LENGTHS) + 200_000)
    # each moved sample costs about its own int64 tokens (twice: input_ids and labels) plus pickle's framing
    assert sum(s["moved_bytes"] for s in stats) < moved * (16 * max(LENGTHS) + 2_000) < corpus_bytes
