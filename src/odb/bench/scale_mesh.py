"""The scale section's meshes and collectives: what an optimizer step costs in collectives at 8-1,024 ranks, and
how a data-parallel x context-parallel mesh plans against pure data parallelism.

**Collectives** (``step_collectives``): the collectives one rank runs per optimizer step with
``global_batch_size`` planned across ranks (``step_plan="global"``), counted from odb's own message layouts
(``odb.epoch.ranks.HeaderMessage``, ``odb.epoch.global_step.StepTable``, the known-lengths step exchange): with
known lengths (``lengths=``) every rank computes each step's table (odb.epoch.local_table), so the batch thread
exchanges one header per *epoch* and the training thread one message per step (the step's supervised tokens,
which also carries failures); with online lengths the batch thread exchanges a header, the step table, the
move's sizes (then the samples, an all-to-all) and a confirmation per 4 micro-batches, ahead of training.
tests/bench/test_scale_mesh.py checks the counts against the gathers of real loaders (thread ranks).

Each all-gather is priced as gloo and NCCL run it, a ring: T = (P - 1) x (alpha + m / beta) for m bytes per rank
over P ranks. Constants (``LINKS``): gloo over TCP, alpha = 50 us per hop and beta = 3 GB/s (an assumption for
kernel TCP between hosts on 25 GbE: its round trip within a rack is tens of microseconds, and gloo adds its own
software overhead; ``measure_gloo_hop`` gives this machine's loopback figure, a floor); NCCL, alpha = 6 us per
ring step and beta = 25 GB/s (NCCL's Simple protocol per-hop latency, ~6 us, as Hu et al., "Demystifying NCCL",
arXiv 2507.04786, measure it, and half of a 400 Gb/s NDR link per GPU). odb's exchange runs on gloo; the NCCL
column says what the same messages would cost on a GPU group. The step's compute beside them: ``STEP_S`` = 1 s.

**Meshes** (``mesh_cells``): G GPUs as R = G / cp replicas of cp context-parallel ranks, against pure data
parallelism over the same R replicas (R GPUs), the same lengths and samples per step (``share`` per replica)
and the same cap per GPU: a CP replica plans under cp x the cap, pads every length to 2 x cp, and each of its
GPUs holds its micro-batch's tokens / cp. Step efficiency as the section defines it (DDP), per GPU. And the
step's bound (its longest sample on one rank) against the same step with a CP group of 2 and 4 for its
micro-batches: how much a per-micro-batch CP degree (dynamic CP) would gain on the heavy tails, planning only.

    >>> [c.name for c in step_collectives("known", world=8, share=4, dims=1, micro_steps=2)]
    ['step exchange (supervised tokens, failures)', 'epoch header (per epoch)']
    >>> round(ring_seconds(1024, 64, LINKS["gloo"]) * 1e3, 1)   # one gather of 64 bytes per rank, 1,024 ranks
    51.2
"""

from __future__ import annotations

import math
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

STEP_S = 1.0  # the step's compute the collectives are priced beside
EPOCH_STEPS = 1000  # optimizer steps per epoch, to spread the per-epoch header
MESH_WORLDS = (8, 32, 128, 1024)
MESH_CPS = (2, 4)
COLLECTIVE_WORLDS = (8, 32, 128, 1024)


class Link(NamedTuple):
    """A ring's per-hop latency (seconds) and bandwidth (bytes per second)."""

    alpha: float
    beta: float


LINKS = {"gloo": Link(50e-6, 3e9), "nccl": Link(6e-6, 25e9)}


class Collective(NamedTuple):
    """One kind of collective a rank runs: what, bytes per rank, how many per optimizer step, which thread."""

    name: str
    bytes_per_rank: int
    per_step: float
    thread: str  # "training" (the loop waits for it) or "batch" (ahead of training)
    kind: str = "all_gather"


def header_ints() -> int:
    """int64 of a header or confirmation message (with its status word)."""
    from odb.comm.agreement import agreed_values
    from odb.config import ODBConfig
    from odb.epoch.ranks import HeaderMessage

    return 1 + HeaderMessage(agreed_values(ODBConfig(token_budget=64), shuffle=True)).size


def step_collectives(mode: str, *, world: int, share: int, dims: int, micro_steps: int,
                     moved_bytes: int = 0) -> List[Collective]:
    """The collectives of one optimizer step on one rank (``mode``: "known" or "online" lengths), with ``share``
    samples per rank per step, ``dims`` length dimensions and ``micro_steps`` micro-batches per step;
    ``moved_bytes``: what the move sends per rank per step (online)."""
    from odb.epoch.global_step import StepTable

    header = 8 * header_ints()
    if mode == "known":
        return [Collective("step exchange (supervised tokens, failures)", 8 * (share + 1), 1.0, "training"),
                Collective("epoch header (per epoch)", header, 1.0 / EPOCH_STEPS, "batch")]
    table = 8 * (1 + share * (len(StepTable.FIELDS) + dims))
    out = [Collective("header", header, 1.0, "batch"), Collective("step table", table, 1.0, "batch"),
           Collective("move sizes", 8 * (1 + world), 1.0, "batch"),
           Collective("confirmation", header, math.ceil(micro_steps / 4), "batch")]
    if moved_bytes:
        out.append(Collective("move (samples)", int(moved_bytes), 1.0, "batch", kind="all_to_all"))
    return out


def ring_seconds(world: int, bytes_per_rank: int, link: Link, kind: str = "all_gather") -> float:
    """A ring collective's time: (P - 1) hops of alpha + the bytes each hop carries / beta. An all-gather's hop
    carries one rank's part; an all-to-all sends each rank's parts to the others, ``bytes_per_rank`` in all."""
    if world <= 1:
        return 0.0
    hop = bytes_per_rank if kind == "all_gather" else bytes_per_rank / (world - 1)
    return (world - 1) * (link.alpha + hop / link.beta)


def priced(collectives: Sequence[Collective], world: int) -> Dict[str, Any]:
    """Per link: seconds per step on the training thread and on the batch thread, as a share of ``STEP_S``, and
    whether the batch thread's part is hidden behind the step (it runs ahead of training when shorter)."""
    out: Dict[str, Any] = {"collectives": sum(c.per_step for c in collectives),
                           "bytes": sum(c.per_step * c.bytes_per_rank for c in collectives)}
    for name, link in LINKS.items():
        seconds = {t: sum(c.per_step * ring_seconds(world, c.bytes_per_rank, link, c.kind)
                          for c in collectives if c.thread == t) for t in ("training", "batch")}
        out[name] = {"training_s": seconds["training"], "batch_s": seconds["batch"],
                     "share_of_step": seconds["training"] / STEP_S, "batch_hidden": seconds["batch"] < STEP_S}
    return out


def collective_rows(share: int = 16, dims: int = 1, micro_steps: int = 4, moved_bytes: int = 160_000,
                    worlds: Sequence[int] = COLLECTIVE_WORLDS) -> List[Dict[str, Any]]:
    """For each world size and mode, the step's collectives counted and priced (a row each)."""
    rows = []
    for world in worlds:
        for mode in ("known", "online"):
            cols = step_collectives(mode, world=world, share=share, dims=dims, micro_steps=micro_steps,
                                    moved_bytes=moved_bytes if mode == "online" else 0)
            rows.append({"world": world, "mode": mode, "detail": [c._asdict() for c in cols], **priced(cols, world)})
    return rows


def measure_gloo_hop(world: int = 4, repeats: int = 200) -> Dict[str, Any]:
    """This machine's gloo all-gather of 8 int64 over ``world`` loopback processes: median seconds per ring hop
    (a floor for alpha: no network)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_hop_worker, args=(r, world, port, repeats, queue)) for r in range(world)]
    for p in procs:
        p.start()
    times = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    per_hop = float(np.median(times)) / max(world - 1, 1)
    return {"world": world, "repeats": repeats, "gather_s": float(np.median(times)), "per_hop_s": per_hop}


def _hop_worker(rank: int, world: int, port: int, repeats: int, queue: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    x = torch.zeros(8, dtype=torch.int64)
    parts = [torch.empty_like(x) for _ in range(world)]
    for _ in range(20):
        dist.all_gather(parts, x)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dist.all_gather(parts, x)
        samples.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    queue.put(float(np.median(samples)))


# ---- meshes ------------------------------------------------------------------------------------------------------


def mesh_step(lengths: np.ndarray, replicas: int, cp: int, cap: int, overhead: float) -> List[List[Any]]:
    """One step of ``lengths`` (every replica's samples) planned over ``replicas`` by ``plan_global_step``, each
    replica of ``cp`` GPUs (cp x ``cap`` per replica, lengths padded to 2 x cp), as per-GPU micro-batches
    (odb.bench.scale.MicroBatch: a replica's tokens / cp)."""
    import odb
    from odb.bench.step_figures import MicroBatch
    from odb.plan.costs.cost import CostModel
    from odb.plan.steps.global_plan import plan_global_step

    cfg = odb.ODBConfig(token_budget=cap, context_parallel=cp, micro_batch_cost=overhead)
    cost = CostModel.from_config(cfg)
    table = lengths.reshape(-1, 1)
    plan = plan_global_step(table, replicas, cost, overhead * cp)  # a micro-batch's fixed cost on each of its cp GPUs
    padded = cost.pad(table).ravel()
    out = []
    for groups in plan.ranks:
        out.append([MicroBatch(len(g) * int(padded[g].max()) / cp, int(lengths[g].sum()) / cp,
                               int(lengths[g].max()) / cp) if len(g) else None for g in groups])
    return out


def mesh_cells(pool: np.ndarray, *, share: int = 16, steps: int = 8, worlds: Sequence[int] = MESH_WORLDS,
               cps: Sequence[int] = MESH_CPS, cap: Optional[int] = None, overhead: Optional[float] = None,
               seed: int = 0) -> List[Dict[str, Any]]:
    """Per (GPUs, cp): the median step efficiency of the mesh and of pure DP over the same replicas and steps, their
    ratio, and the median bound of the pure-DP step against the same step with CP groups of 2 and 4."""
    from odb.bench.step_figures import OVERHEAD, TOKEN_BUDGET, draw, step_efficiency

    cap = TOKEN_BUDGET if cap is None else cap
    overhead = OVERHEAD if overhead is None else overhead
    rows = []
    for gpus in worlds:
        for cp in cps:
            replicas = gpus // cp
            lengths = draw(pool, replicas * share * steps, seed)
            mesh, dp = [], []
            for k in range(steps):
                part = lengths[k * replicas * share:(k + 1) * replicas * share]
                mesh.append(step_efficiency(mesh_step(part, replicas, cp, cap, overhead), overhead, cap)["ddp"])
                dp.append(step_efficiency(mesh_step(part, replicas, 1, cap, overhead), overhead, cap)["ddp"])
            med_mesh, med_dp = float(np.median(mesh)), float(np.median(dp))
            rows.append({"gpus": gpus, "cp": cp, "replicas": replicas, "share": share, "steps": steps,
                         "mesh_ddp": med_mesh, "dp_ddp": med_dp, "ratio": med_mesh / med_dp})
    return rows


def cp_bounds(pool: np.ndarray, *, worlds: Sequence[int] = MESH_WORLDS, shares: Sequence[int] = (1, 4),
              steps: int = 64, overhead: Optional[float] = None, seed: int = 0) -> List[Dict[str, Any]]:
    """Per (world, share): the median bound of a step (its fair share against its longest sample on one rank),
    and the same step's bound with its longest micro-batch on a CP group of 2 and 4 (the longest sample then
    costs length / cp on each of its GPUs), on the long-context lengths ``pool``; and the share of steps the
    longest sample bounds."""
    from odb.bench.step_figures import OVERHEAD, draw

    overhead = OVERHEAD if overhead is None else overhead
    rows = []
    for world in worlds:
        for share in shares:
            lengths = draw(pool, world * share * steps, seed).reshape(steps, world * share)
            fair = lengths.sum(axis=1) / world + overhead
            longest = lengths.max(axis=1).astype(np.float64)
            bound = {str(c): float(np.median(fair / np.maximum(fair, longest / c + overhead))) for c in (1, 2, 4)}
            rows.append({"world": world, "share": share, "steps": steps, "bound": bound,
                         "bounded_steps": float(np.mean(longest + overhead > fair))})
    return rows


def mesh_goals(mesh: List[Dict[str, Any]], collectives: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The issue's goals: mesh step efficiency >= 0.95 x pure DP's; known lengths: no per-step collective but the
    step exchange; online: the batch thread's exchanges hidden behind a 1 s step at 1,024 ranks (gloo)."""
    worst = min(mesh, key=lambda r: r["ratio"]) if mesh else None
    known = [r for r in collectives if r["mode"] == "known"]
    online_big = [r for r in collectives if r["mode"] == "online" and r["world"] == max(x["world"] for x in collectives)]
    out = []
    if worst is not None:
        out.append({"goal": "mesh step efficiency / pure DP's (DP x CP, same replicas, median over steps)",
                    "measured": f"{worst['ratio']:.3f} (worst: {worst['gpus']} GPUs, cp {worst['cp']})",
                    "target": ">= 0.95", "met": worst["ratio"] >= 0.95})
    if known:
        per_step = max(sum(c["per_step"] for c in r["detail"] if "per epoch" not in c["name"]) for r in known)
        out.append({"goal": "known lengths: collectives per step beyond the step exchange (failures, tokens)",
                    "measured": f"{per_step - 1:g}", "target": "0", "met": per_step - 1 == 0})
    for r in online_big:
        out.append({"goal": f"online lengths at {r['world']} ranks: batch-thread exchanges per step (gloo model)",
                    "measured": f"{r['gloo']['batch_s'] * 1e3:.0f} ms, hidden behind a {STEP_S:g} s step: "
                                f"{r['gloo']['batch_hidden']}", "target": f"< {STEP_S:g} s (hidden)",
                    "met": r["gloo"]["batch_hidden"]})
    return out


LONG_RANGE = (16, 8192)  # the long-context lengths of the CP bound (DESIGN's public workloads' clip)


def run_mesh_section(pool: np.ndarray, raw: np.ndarray, workload: str = "sharegpt", quick: bool = False
                     ) -> Dict[str, Any]:
    """The section's mesh and collective figures (plain JSON): meshes on the scale section's lengths ``pool``
    (clipped as the section clips them) and cap; the CP bound on the set's ``raw`` lengths clipped to
    ``LONG_RANGE`` instead (a (source, target) pair counts as one sequence)."""
    t0 = time.perf_counter()
    worlds = (8, 32) if quick else MESH_WORLDS
    mesh = mesh_cells(np.asarray(pool), steps=2 if quick else 8, worlds=worlds)
    raw = np.asarray(raw, dtype=np.int64)
    raw = raw.sum(axis=1) if raw.ndim == 2 else raw
    bounds = cp_bounds(np.clip(raw, *LONG_RANGE), worlds=worlds, steps=8 if quick else 64)
    collectives = collective_rows(worlds=(8, 32) if quick else COLLECTIVE_WORLDS)
    return {"workload": workload, "mesh": mesh, "cp_bounds": bounds, "long_range": list(LONG_RANGE),
            "collectives": collectives, "links": {k: v._asdict() for k, v in LINKS.items()}, "step_s": STEP_S,
            "goals": mesh_goals(mesh, collectives), "wall_s": time.perf_counter() - t0}


def mesh_lines(section: Dict[str, Any]) -> List[str]:
    """The section's mesh and collective figures as text lines (odb.bench.report's scale table)."""
    out = [f"meshes ({section['workload']}, same lengths and cap per GPU; DDP step efficiency, median over steps):"]
    for r in section["mesh"]:
        out.append(f"  {r['gpus']} GPUs = {r['replicas']} replicas x cp {r['cp']}, {r['share']} samples per replica: "
                   f"mesh {r['mesh_ddp']:.3f}, pure DP over {r['replicas']} replicas {r['dp_ddp']:.3f} "
                   f"(ratio {r['ratio']:.3f})")
    lo, hi = section["long_range"]
    out.append(f"step bound (lengths clipped to {lo}..{hi}), its longest sample on 1 / 2 / 4 GPUs (dynamic CP):")
    for r in section["cp_bounds"]:
        b = r["bound"]
        out.append(f"  {r['world']} ranks x {r['share']}: {b['1']:.3f} / {b['2']:.3f} / {b['4']:.3f} "
                   f"({100 * r['bounded_steps']:.0f}% of steps bounded by their longest sample)")
    links = section["links"]
    out.append(f"collectives per optimizer step (global plan, 16 samples per rank, 4 micro-batches, ring model "
               f"T = (P-1)(alpha + m/beta); gloo alpha {links['gloo']['alpha'] * 1e6:.0f} us, beta "
               f"{links['gloo']['beta'] / 1e9:g} GB/s; NCCL alpha {links['nccl']['alpha'] * 1e6:.0f} us, beta "
               f"{links['nccl']['beta'] / 1e9:g} GB/s; beside a {section['step_s']:g} s step):")
    for r in section["collectives"]:
        out.append(f"  {r['world']} ranks, {r['mode']} lengths: {r['collectives']:.3g} collectives, "
                   f"{r['bytes'] / 1e3:.1f} kB per rank; training thread gloo {1e3 * r['gloo']['training_s']:.1f} ms "
                   f"/ NCCL {1e3 * r['nccl']['training_s']:.1f} ms, batch thread (ahead of training) gloo "
                   f"{1e3 * r['gloo']['batch_s']:.1f} ms / NCCL {1e3 * r['nccl']['batch_s']:.1f} ms")
    return out
