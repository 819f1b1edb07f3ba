"""Meshes on real gloo processes: 4 ranks as dp 2 x tp 2 and as dp 2 x cp 2 (torch's DeviceMesh on CPU).

Every peer of a data-parallel replica must train the same batch at every micro-step: odb plans over the
replicas and each peer computes its replica's plan from the same inputs (odb.comm.replicas). Here, for known,
online and streamed lengths, padded and packed, two epochs each, with ``check_peers`` on: every peer's batches
are identical byte for byte (their digests, odb.epoch.peer_check), each replica's batches are those of a plain
2-rank run without a mesh, and every sample of the epoch comes once per replica. Training (a per-token model,
so a CP rank's shard computes exactly its tokens' losses) gives each optimizer step the gradient of the plain
loop over ``DistributedSampler(num_replicas=dp)``'s step, also under ``token_budget="auto"`` (each rank's own
memory meter) and an OOM injected on one peer only. A mid-epoch resume and an elastic one (dp 2 -> dp 1 x tp 2)
continue exactly; a failure on one peer reaches every rank within seconds, naming it.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Sequence

import pytest
from torch.utils.data import IterableDataset

from dist_harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

N, BUDGET, GLOBAL = 48, 96, 8  # samples, per-GPU token budget, samples per optimizer step (all replicas)
VOCAB, IGNORE = 50, -100


def lengths_of(n: int = N) -> List[int]:
    from helpers import known_lengths

    return [4 + v for v in known_lengths(n, 1, 36, seed=7)]


def sample(i: int, length: int) -> Dict[str, Any]:
    import torch

    ids = (torch.arange(length) * 7 + i) % VOCAB
    labels = ids.clone()
    labels[1::3] = IGNORE
    return {"input_ids": ids, "labels": labels, "idx": i}


class Samples:
    """Map-style: sample i of ``lengths``."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = list(lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return sample(i, self.lengths[i])


def mesh_collate(samples: List[Dict[str, Any]]) -> Dict[str, Any]:
    """input_ids (0) and labels (-100) padded to the longest sample; the sample indices."""
    import torch

    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, :len(s["input_ids"])] = s["input_ids"]
        labels[row, :len(s["labels"])] = s["labels"]
    return {"input_ids": ids, "labels": labels, "idx": torch.tensor([s["idx"] for s in samples])}


def make_mesh(kind: str, dp: int = 2) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", kind))


def loader_for(mesh: Any, mode: str, layout: str, **options: Any) -> Any:
    """A loader over this rank's replica share: map-style with known or online lengths, or a stream."""
    import torch

    import odb

    lengths = lengths_of()
    dp = mesh["dp"] if mesh is not None else None
    replica, replicas = (dp.get_local_rank(), dp.size()) if dp is not None else (torch.distributed.get_rank(),
                                                                                  torch.distributed.get_world_size())
    common = {"token_budget": BUDGET, "global_batch_size": GLOBAL, "seed": 1, "shift_labels": False,
              "layout": layout, "collate_fn": mesh_collate if layout == "padded" else None,
              **({"device_mesh": mesh} if mesh is not None else {}), **options}
    if mode == "stream":
        shard = list(range(replica, N, replicas))
        return odb.ODBDataLoader(StreamOf(lengths, shard), **common)
    sampler = torch.utils.data.DistributedSampler(Samples(lengths), num_replicas=replicas, rank=replica, seed=1)
    return odb.ODBDataLoader(Samples(lengths), sampler=sampler, lengths=lengths if mode == "known" else None,
                             **common)


class StreamOf(IterableDataset):
    """An IterableDataset of the samples ``shard`` (one replica's), in order."""

    def __init__(self, lengths: Sequence[int], shard: Sequence[int]) -> None:
        self.lengths, self.shard = list(lengths), list(shard)

    def __iter__(self):
        for i in self.shard:
            yield sample(i, self.lengths[i])



def step_record(batch: Any, info: Any) -> Dict[str, Any]:
    from odb.epoch.peer_check import batch_digest

    idx = batch["idx"].tolist() if "idx" in batch else list(info.sample_ids)
    return {"step": info.step, "micro": (info.micro_step, info.micro_steps), "ids": list(info.sample_ids), "idx": idx,
            "ghost": info.is_ghost, "digest": batch_digest(batch, info), "scale": info.loss_scale}


# ---- the batches: identical on every peer, a plain run's on each replica -------------------------------------------

SCENARIOS = [(mode, layout) for mode in ("known", "online", "stream") for layout in ("padded", "packed")]


def two_epochs(loader: Any, mode: str) -> List[List[Dict[str, Any]]]:
    import odb

    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        if mode != "stream":
            loader.sampler.set_epoch(epoch)
        epochs.append([step_record(b, odb.pop_step_info(b)) for b in loader])
    return epochs


def mesh_batches(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    return {f"{kind}/{mode}/{layout}": two_epochs(loader_for(mesh, mode, layout, check_peers=True), mode)
            for kind in ("tp", "cp") for mesh in [make_mesh(kind)] for mode, layout in SCENARIOS}


def plain_batches(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """The same loaders without a mesh, on 2 ranks (one per replica), with context_parallel where the mesh has cp."""
    return {f"{kind}/{mode}/{layout}": two_epochs(loader_for(None, mode, layout,
                                                             context_parallel=2 if kind == "cp" else 1), mode)
            for kind in ("tp", "cp") for mode, layout in SCENARIOS}


def test_every_peer_trains_its_replicas_batches_byte_for_byte(tmp_path):
    meshed = run_ranks("test_mesh:mesh_batches", 4, {}, tmp_path / "mesh", deadline_s=200)
    plain = run_ranks("test_mesh:plain_batches", 2, {}, tmp_path / "plain", deadline_s=200)
    for key in meshed[0]:
        for process in range(4):
            replica = process // 2
            assert meshed[process][key] == meshed[replica * 2][key], f"{key}: process {process} differs from its peer"
            assert meshed[process][key] == plain[replica][key], f"{key}: replica {replica} is not a plain run's"
        for epoch in range(2):
            if key.endswith("stream/packed"):
                continue  # (a packed row keeps no index; a stream's sample ids are its own positions)
            ids = sorted(i for r in (0, 2) for s in meshed[r][key][epoch] if not s["ghost"] for i in s["idx"])
            assert ids == list(range(N)), f"{key}, epoch {epoch}: every sample once over the replicas"


# ---- training: each optimizer step's update is the plain loop's ------------------------------------------------------


def per_token_model(seed: int = 0) -> Any:
    """Logits of a token from its id and its position only: a CP rank's shard gives exactly its tokens' losses."""
    import torch

    torch.manual_seed(seed)

    class PerToken(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = torch.nn.Embedding(VOCAB, 8, dtype=torch.float64)
            self.pos = torch.nn.Embedding(256, 8, dtype=torch.float64)
            self.head = torch.nn.Linear(8, VOCAB, dtype=torch.float64)

        def forward(self, ids: Any, positions: Any) -> Any:
            return self.head(torch.tanh(self.tok(ids) + self.pos(positions)))

    return PerToken()


def token_losses(model: Any, batch: Dict[str, Any]) -> Any:
    """(sum of token losses, supervised tokens) of a (shard of a) batch."""
    import torch

    ids = batch["input_ids"]
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(ids.shape[1]).expand_as(ids)
    logits = model(ids, positions)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1),
                                             ignore_index=IGNORE, reduction="sum")
    return loss, int((batch["labels"] != IGNORE).sum())


class Meter:
    """token_budget="auto"'s memory meter on CPU: bytes proportional to the last micro-batch's tokens, times this
    process's own factor (peers measure differently: odb must agree on one budget)."""

    def __init__(self, factor: float) -> None:
        self.factor, self.peak = factor, None

    def __call__(self) -> Any:
        peak, self.peak = self.peak, None
        return peak


class FakeOOM(Exception):
    pass


def plain_steps(mode: str) -> List[List[int]]:
    """The sample indices of each optimizer step of the plain loop: GLOBAL / 2 of each replica's sampler order."""
    import torch

    lengths = lengths_of()
    if mode == "stream":
        orders = [list(range(r, N, 2)) for r in range(2)]
    else:
        orders = [list(torch.utils.data.DistributedSampler(Samples(lengths), num_replicas=2, rank=r, seed=1))
                  for r in range(2)]
    per = GLOBAL // 2
    return [[i for order in orders for i in order[k * per:(k + 1) * per]] for k in range(N // GLOBAL)]


def reference_grads(steps: List[List[int]], packed: bool) -> List[List[Any]]:
    """Each step's gradient of its token mean, in one process (a packed row's collate leaves each sample's first
    label out, as a causal LM's shift does)."""
    import torch

    lengths, out = lengths_of(), []
    for ids in steps:
        model = per_token_model()
        total, count = 0.0, 0
        for i in ids:
            s = sample(i, lengths[i])
            if packed:
                s["labels"][0] = IGNORE
            loss, n = token_losses(model, {"input_ids": s["input_ids"][None], "labels": s["labels"][None]})
            total, count = total + loss, count + n
        (total / count).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


TRAINING = [("tp", "known", "padded", ""), ("tp", "online", "padded", "auto"), ("tp", "stream", "padded", ""),
            ("tp", "known", "padded", "oom"), ("cp", "known", "packed", ""), ("cp", "online", "padded", "oom")]


def mesh_training(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """Per optimizer step, the max relative error of the step's gradient against the plain loop's; the passes
    of each micro-batch (equal on peers)."""
    import contextlib
    import dataclasses

    import torch
    import torch.distributed as dist

    import odb
    from odb.train.oom import train_step_with_oom_fallback

    out: Dict[str, Any] = {}
    for kind, mode, layout, extra in TRAINING:
        mesh = make_mesh(kind)
        peer = mesh[kind].get_local_rank()
        meter = Meter(1.0 + 0.25 * peer)
        options = {"token_budget": "auto", "memory_cap_bytes": 8 * 200, "memory_meter": meter,
                   "auto_start_budget": 60} if extra == "auto" else {}
        loader = loader_for(mesh, mode, layout, **options)
        model = per_token_model()
        group = mesh["dp"].get_group() if kind == "tp" else None  # cp: every rank holds its own tokens' gradient
        cp = 2 if kind == "cp" else 1
        oom_here = extra == "oom" and rank == p["oom_rank"][kind]
        errors, passes, refs = [], [], reference_grads(plain_steps(mode), layout == "packed")
        for batch in loader:
            info = odb.pop_step_info(batch)
            part = odb.context_shard(batch, peer, cp) if kind == "cp" else batch
            meter.peak = int(8 * meter.factor * batch["input_ids"].numel())
            # the step's token mean: each process's (shard's) token sum / the step's supervised tokens, summed
            # over the replicas (tp) or over every rank (cp) below; as a scaled mean for the OOM fallback
            _, local = token_losses(model, part) if extra == "oom" else (None, 0)
            if extra == "oom":
                def loss_fn(b: Any) -> Any:
                    if oom_here and b["input_ids"].shape[0] > 1:
                        raise torch.OutOfMemoryError("fake: more than one row")
                    loss, n = token_losses(model, b)
                    return loss / max(n, 1)

                scaled = dataclasses.replace(info, loss_scale=local / info.global_loss_tokens if local else 0.0)
                outcome = train_step_with_oom_fallback(loss_fn, part, scaled, model=model,
                                                       no_sync=contextlib.nullcontext,
                                                       counters=loader.odb_oom_counters)
                passes.append(outcome.passes)
            else:
                loss, _ = token_losses(model, part)
                (loss / info.global_loss_tokens).backward()
            if info.is_last_micro_step:
                for t in model.parameters():
                    dist.all_reduce(t.grad, group=group)
                ref = refs[len(errors)]
                errors.append(max(float((t.grad - r).abs().max() / r.abs().max())
                                  for t, r in zip(model.parameters(), ref)))
                model.zero_grad(set_to_none=False)
        out[f"{kind}/{mode}/{layout}/{extra}"] = {"errors": errors, "passes": passes}
    return out


def test_every_step_updates_as_the_plain_loop_does(tmp_path):
    """Also under auto (peers measure differently) and an OOM on one peer only (its replica splits alike)."""
    results = run_ranks("test_mesh:mesh_training", 4, {"oom_rank": {"tp": 1, "cp": 3}}, tmp_path, deadline_s=200)
    for key in results[0]:
        for process in range(4):
            got = results[process][key]
            assert len(got["errors"]) == N // GLOBAL, f"{key}: process {process} ran {len(got['errors'])} steps"
            assert max(got["errors"]) < 1e-9, f"{key}: process {process}'s updates differ: {got['errors']}"
            assert got["passes"] == results[process // 2 * 2][key]["passes"], f"{key}: peers ran other passes"
        if key.endswith("oom"):
            assert max(p for r in results for p in r[key]["passes"]) > 1, f"{key}: no OOM split happened"


# ---- resume: mid-epoch on the same mesh, elastic onto dp 1 x tp 2 -------------------------------------------------


def mesh_resume(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """The epoch straight; the epoch stopped after ``stop`` micro-batches, saved and resumed by a new loader. Every
    replica's first peer saves its state for the elastic run."""
    import torch

    import odb

    mesh = make_mesh("tp")
    out: Dict[str, Any] = {}
    for mode in ("known", "online"):
        straight = [step_record(b, odb.pop_step_info(b)) for b in loader_for(mesh, mode, "padded")]
        loader = loader_for(mesh, mode, "padded")
        head = []
        for batch in loader:
            head.append(step_record(batch, odb.pop_step_info(batch)))
            if len(head) == p["stop"]:
                break
        state = loader.state_dict()
        if mesh["tp"].get_local_rank() == 0:
            torch.save(state, f"{p['dir']}/{mode}-replica{mesh['dp'].get_local_rank()}.pt")
        resumed = loader_for(mesh, mode, "padded")
        resumed.load_state_dict(state)
        tail = [step_record(b, odb.pop_step_info(b)) for b in resumed]
        out[mode] = {"straight": straight, "head": head, "tail": tail}
    return out


def mesh_elastic(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """dp 1 x tp 2 resumes the list of both replicas' states."""
    import torch

    import odb

    mesh = make_mesh("tp", dp=1)
    out = {}
    for mode in ("known", "online"):
        states = [torch.load(f"{p['dir']}/{mode}-replica{r}.pt", weights_only=True) for r in range(2)]
        loader = loader_for(mesh, mode, "padded")
        loader.load_state_dict(states)
        out[mode] = [step_record(b, odb.pop_step_info(b)) for b in loader]
    return out


def test_a_mid_epoch_and_an_elastic_resume_continue_exactly(tmp_path):
    params = {"stop": 5, "dir": str(tmp_path)}
    first = run_ranks("test_mesh:mesh_resume", 4, params, tmp_path / "mesh", deadline_s=150)
    elastic = run_ranks("test_mesh:mesh_elastic", 2, params, tmp_path / "elastic", deadline_s=150)
    for mode in ("known", "online"):
        for process in range(4):
            got = first[process][mode]
            assert got == first[process // 2 * 2][mode], f"{mode}: process {process} differs from its peer"
            assert [s["digest"] for s in got["head"] + got["tail"]] == [s["digest"] for s in got["straight"]], \
                f"{mode}: process {process}'s resumed epoch is not the straight one"
        assert elastic[0][mode] == elastic[1][mode], f"{mode}: the elastic peers differ"
        before = [i for r in (0, 2) for s in first[r][mode]["head"] if not s["ghost"] for i in s["idx"]]
        after = [i for s in elastic[0][mode] if not s["ghost"] for i in s["idx"]]
        assert sorted(before + after) == list(range(N)), f"{mode}: the elastic resume is not the rest of the epoch"


# ---- process_group= with peer_group=: the same replicas as the mesh -----------------------------------------------


def peer_groups(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    import odb

    mesh = make_mesh("tp")
    groups = {"process_group": mesh["dp"].get_group(), "peer_group": mesh["tp"].get_group(), "device_mesh": None}
    out = {}
    for mode in ("known", "online"):
        meshed = [step_record(b, odb.pop_step_info(b)) for b in loader_for(mesh, mode, "padded")]
        grouped = [step_record(b, odb.pop_step_info(b)) for b in loader_for(mesh, mode, "padded", **groups)]
        out[mode] = {"mesh": meshed, "groups": grouped}
    return out


def test_a_data_parallel_group_with_a_peer_group_plans_as_the_mesh(tmp_path):
    results = run_ranks("test_mesh:peer_groups", 4, {}, tmp_path, deadline_s=120)
    for process, got in enumerate(results):
        for mode, runs in got.items():
            assert runs["groups"] == runs["mesh"], f"{mode}: process {process}'s groups plan otherwise than the mesh"
            assert runs["groups"] == results[process // 2 * 2][mode]["groups"]


# ---- a failure on one peer reaches every rank, naming it ---------------------------------------------------------


class FailingCollate:
    """mesh_collate, raising at its ``at``-th batch on this process when ``fail``."""

    def __init__(self, fail: bool, at: int) -> None:
        self.fail, self.at, self.calls = fail, at, 0

    def __call__(self, samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        self.calls += 1
        if self.fail and self.calls == self.at:
            raise ValueError("a sample this collate cannot take (injected)")
        return mesh_collate(samples)


def mesh_failure(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    import odb

    mesh = make_mesh("tp")
    loader = loader_for(mesh, "online", "padded", collate_fn=FailingCollate(rank == p["failing"], 3))
    steps = 0
    try:
        for batch in loader:
            odb.pop_step_info(batch)
            steps += 1
    except Exception as err:  # what the test checks
        return {"error": type(err).__name__, "message": str(err), "at": time.time(), "steps": steps}
    return {"error": None, "at": time.time(), "steps": steps}


def test_a_failure_on_one_peer_reaches_every_rank_naming_it(tmp_path):
    results = run_ranks("test_mesh:mesh_failure", 4, {"failing": 3}, tmp_path, deadline_s=90)
    assert results[3]["error"] == "ValueError"
    for process in (0, 1, 2):
        got = results[process]
        assert got["error"] == "ODBRankFailed", got
        assert "rank 3 failed" in got["message"] and "injected" in got["message"], got["message"]
        assert abs(got["at"] - results[3]["at"]) < 10, f"process {process} heard of it {got['at'] - results[3]['at']} s late"
    assert len({r["steps"] for r in results}) == 1, "every rank stopped at the same step"


# ---- the guide's example: DTensor tensor parallelism on a 4-process mesh ------------------------------------------


def guide_example(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """Run docs/distributed.md's mesh example as written; then train the same model without odb and without tensor
    parallelism, one process, on each step's samples of the plain loop (the union of both replicas' 4), and
    compare the parameters."""
    import re
    from pathlib import Path

    import torch

    text = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text()
    code = re.search(r"<!-- odb-mesh-example -->\n```python\n(.*?)```", text, re.S).group(1)
    scope: Dict[str, Any] = {"__name__": "mesh_example"}
    exec(compile(code, "docs/distributed.md (mesh example)", "exec"), scope)
    trained = [t.full_tensor() if hasattr(t, "full_tensor") else t.detach() for t in scope["model"].parameters()]

    data, collate = scope["data"], scope["collate"]
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 64))
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.5)
    for epoch in range(2):
        orders = []
        for r in range(2):
            sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=r, seed=0)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for k in range(len(orders[0]) // 4):
            batch = collate([data[i] for order in orders for i in order[4 * k:4 * k + 4]])
            logits = ref(batch["input_ids"])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
    error = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(trained, ref.parameters()))
    moved = max(float((a - b).abs().max()) for a, b in zip(trained, per_init()))
    return {"error": error, "moved": moved, "digest": [float(t.sum()) for t in trained]}


def per_init() -> List[Any]:
    import torch

    torch.manual_seed(0)
    return [t.detach() for t in torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64),
                                                    torch.nn.ReLU(), torch.nn.Linear(64, 64)).parameters()]


def test_the_guides_mesh_example_trains_as_the_model_without_odb(tmp_path):
    results = run_ranks("test_mesh:guide_example", 4, {}, tmp_path, deadline_s=150)
    for process, got in enumerate(results):
        assert got["moved"] > 1e-3, "the example did not train"
        assert got["error"] < 1e-4, f"process {process}: parameters off the plain loop's by {got['error']}"
        assert got["digest"] == results[0]["digest"]
