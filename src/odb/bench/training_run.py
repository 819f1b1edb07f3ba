"""One process of the training benchmark: every workload, round and arm, timed epoch by epoch.

``run_throughput(rank, world, params)`` runs in each rank's process (``training_ddp``
starts them): for each workload, ``rounds`` rounds; in each round every arm trains one
epoch over the same samples from the same initial weights, the arm order rotated by
one per round. Under DDP the model is wrapped in ``DistributedDataParallel`` (gloo) and
an epoch is timed from a barrier before its first batch to a barrier after its last, so
the slowest rank sets it. Loading is inside the timed loop; building the loader (and
TRL's offline packing, which is preprocessing) is not.

Per arm: real tokens/s (non-pad tokens trained, all ranks, over the epoch's wall time;
ghost batches excluded), steps per rank, token efficiency (real / padded), real tokens
per micro-batch against the cap, rank 0's seconds inside ``next(loader)`` and the CPU
seconds of its other threads (odb's batch thread, gloo's) during the epoch, and memory: the largest padded tokens of any step
(B x L; a packed row's length) and, on CPU, the bytes autograd saves for backward
(activations, parameters excluded) measured with ``torch.autograd.graph.saved_tensors_hooks``
on each rank's two largest steps after the timed epoch; on CUDA,
``torch.cuda.max_memory_allocated`` over the epoch.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

import odb

from odb.bench.text_data import VOCAB, TextSamples, describe, workload_lengths
from odb.bench.training_arms import ARMS, ATTENTION, ODB_ARMS, arm_settings, build_loader, fixed_batch_size, trl_rows

# use_cache=False: no KV cache in training (with one, transformers would not build a packed row's mask).
MODELS: Dict[str, Dict[str, Any]] = {
    "cpu": dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, use_cache=False),
    "cuda": dict(vocab_size=VOCAB, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=12, use_cache=False),  # ~85M parameters
}


def build_model(device: torch.device, max_len: int, attn: str, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if attn == "odb_varlen":
        odb.register_varlen_attention()
    torch.manual_seed(seed)
    config = LlamaConfig(max_position_embeddings=max_len, attn_implementation=attn, **MODELS[device.type])
    with torch.device(device):  # initialised where it trains (on a GPU: seconds saved per arm and round)
        return LlamaForCausalLM(config)


def wrap(model: torch.nn.Module, world: int) -> torch.nn.Module:
    if world <= 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _barrier(world: int) -> None:
    if world > 1:
        torch.distributed.barrier()


def _counts(batch: Dict[str, Any]) -> Tuple[int, int]:
    """(real, padded) tokens of a batch: a padded batch's mask, or a padding-free row's length."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    real = int(ids.numel()) if mask is None else int(mask.sum())
    return real, int(ids.numel())


def saved_bytes(model: torch.nn.Module, batch: Dict[str, Any], autocast: Any) -> int:
    """Bytes of the tensors autograd saves for backward in one forward of ``batch`` (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        loss = model(**batch).loss
    del loss
    return sum(seen.values())


def _autocast(device: torch.device) -> Callable[[], Any]:
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def set_epoch(loader: Any, epoch: int) -> None:
    """Advance a loader's shuffle to ``epoch`` (odb's loader, a DistributedSampler, a batch sampler)."""
    for obj in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        if obj is not None and hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)
            return


def train_epoch(model: torch.nn.Module, opt: torch.optim.Optimizer, loader: Any, *, odb_arm: bool,
                device: torch.device, world: int, keep_largest: int = 0,
                on_step: Optional[Callable[[int], float]] = None) -> Dict[str, Any]:
    """One epoch; wall seconds from a barrier to a barrier, minus what ``on_step`` (evaluation) returns."""
    autocast = _autocast(device)
    steps = real = padded = max_padded = 0
    largest: List[Tuple[int, int, Dict[str, Any]]] = []
    losses: List[torch.Tensor] = []
    step_s: List[Tuple[int, int, float]] = []  # (padded tokens, longest row, seconds) of each step, this rank
    paused = 0.0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    _barrier(world)
    t0, cpu0, thread0 = time.perf_counter(), time.process_time(), time.thread_time()
    waited = 0.0
    batches = iter(loader)
    while True:
        w0 = time.perf_counter()
        batch = next(batches, None)
        waited += time.perf_counter() - w0
        if batch is None:
            break
        scale, ghost = 1.0, False
        if odb_arm:
            info = odb.pop_step_info(batch)
            scale, ghost = info.loss_scale, info.is_ghost
        r, p = _counts(batch)
        batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with autocast():
            loss = model(**batch).loss
        (loss * scale).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if device.type == "cpu":  # CPU ops are synchronous: the step's wall time, its next() included
            step_s.append((p, int(batch["input_ids"].shape[-1]), time.perf_counter() - w0))
        steps += 1
        max_padded = max(max_padded, p)
        if not ghost:
            real, padded = real + r, padded + p
        if keep_largest and (len(largest) < keep_largest or p > largest[0][0]):
            largest = sorted(largest + [(p, steps, batch)], key=lambda x: x[:2])[-keep_largest:]
        if on_step is not None:
            paused += on_step(steps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # CPU of this process's other threads (odb's batch thread, gloo's) beside the training thread's.
    other_cpu = (time.process_time() - cpu0) - (time.thread_time() - thread0)
    _barrier(world)
    wall = time.perf_counter() - t0 - paused
    out: Dict[str, Any] = {"wall_s": wall, "steps": steps, "real": real, "padded": padded, "max_padded": max_padded,
                           "loader_s": waited, "other_threads_cpu_s": other_cpu, "step_s": step_s,
                           "final_loss": float(torch.stack(losses[-5:]).mean()) if losses else float("nan")}
    if device.type == "cuda":
        out["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    elif largest:
        module = getattr(model, "module", model)
        out["saved_mib"] = max(saved_bytes(module, b, autocast) for _, _, b in largest) / 2**20
    return out


def fit_step_cost(samples: List[Tuple[int, int, float]]) -> Dict[str, float]:
    """Least squares of rank 0's step seconds = a + b x padded tokens + c x padded tokens x row length.

    Fitted over every step of the padded (sdpa) arms of a workload, so it says what a step costs
    apart from its tokens (``a``: optimizer step, gradient all-reduce, dispatch, next()) and per
    token (``b``; ``c`` is attention's share, which grows with the row length). ``a / b`` is the fixed
    cost in tokens: the saving of one step fewer, in tokens of compute.

    Example:
        >>> shapes = [(p, n) for p in (64, 256, 512, 1024, 2048) for n in (16, 64)]
        >>> fit = fit_step_cost([(p, n, 0.01 + 1e-5 * p + 1e-8 * p * n) for p, n in shapes])
        >>> round(fit["per_step_ms"], 3), round(fit["per_step_in_tokens"])
        (10.0, 1000)
    """
    arr = np.asarray(samples, dtype=np.float64)
    x = np.stack([np.ones(len(arr)), arr[:, 0], arr[:, 0] * arr[:, 1]], axis=1)
    coef, *_ = np.linalg.lstsq(x, arr[:, 2], rcond=None)
    pred = x @ coef
    ss_tot = float(((arr[:, 2] - arr[:, 2].mean()) ** 2).sum())
    a, b, c = (float(v) for v in coef)
    return {"per_step_ms": a * 1e3, "per_1k_tokens_ms": b * 1e6, "attention_per_1k_tokens_x_1k_length_ms": c * 1e9,
            "per_step_in_tokens": a / b if b > 0 else float("nan"), "steps_fitted": int(len(arr)),
            "r2": 1.0 - float(((arr[:, 2] - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")}


def _reduce(values: List[float], op: str, world: int) -> List[float]:
    if world <= 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t, op=getattr(torch.distributed.ReduceOp, op))
    return t.tolist()


def warm_up(device: torch.device, world: int, max_len: int) -> None:
    """First-call costs (allocator growth, DDP buckets, kernel choice) land on no arm."""
    for attn in ("sdpa", "odb_varlen"):
        model = wrap(build_model(device, max_len, attn, seed=1), world)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(1, VOCAB, (4, max_len // 4), device=device)
        batch: Dict[str, Any] = {"input_ids": ids, "labels": ids}
        if attn == "sdpa":
            batch["attention_mask"] = torch.ones_like(ids)
        else:
            batch = {"input_ids": ids.reshape(1, -1), "labels": ids.reshape(1, -1),
                     "position_ids": torch.arange(max_len // 4, device=device).repeat(4)[None]}
        for _ in range(2):
            with _autocast(device)():
                model(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


def _summary(runs: List[Dict[str, Any]]) -> Dict[str, float]:
    rates = [r["tokens_per_s"] for r in runs]
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


def run_workload(name: str, samples: int, *, rank: int, world: int, device: torch.device, cap: int, rounds: int,
                 arms: Tuple[str, ...] = ARMS, full_length: bool = False,
                 log: Callable[[str], None] = lambda m: None) -> Dict[str, Any]:
    lengths = workload_lengths(name, samples, full_length=full_length)
    dataset = TextSamples(lengths)
    max_len = int(lengths.max())
    rows = trl_rows(dataset, cap) if "trl_packing" in arms else None
    runs: Dict[str, List[Dict[str, Any]]] = {a: [] for a in arms}
    step_samples: List[Tuple[int, int, float]] = []
    for r in range(rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for arm in order:
            loader = build_loader(arm, dataset, cap, rank=rank, world=world, rows=rows)
            model = wrap(build_model(device, max(max_len, 16), ATTENTION.get(arm, "sdpa")), world)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            e = train_epoch(model, opt, loader, odb_arm=arm in ODB_ARMS, device=device, world=world,
                            keep_largest=2 if r == 0 else 0)
            real, padded, steps = _reduce([e["real"], e["padded"], e["steps"]], "SUM", world)
            mx = _reduce([e["max_padded"], e.get("saved_mib", 0.0), e.get("peak_mib", 0.0), e["steps"]], "MAX",
                         world)
            run = {"wall_s": e["wall_s"], "tokens_per_s": real / e["wall_s"], "real_tokens": int(real),
                   "loader_s": e["loader_s"], "other_threads_cpu_s": e["other_threads_cpu_s"],
                   "padded_tokens": int(padded), "steps": e["steps"], "steps_equal_on_ranks": steps == mx[3] * world,
                   "max_step_padded_tokens": int(mx[0]), "final_loss": e["final_loss"]}
            if r == 0:
                run["saved_mib" if device.type == "cpu" else "peak_mib"] = mx[1] if device.type == "cpu" else mx[2]
            if ATTENTION.get(arm, "sdpa") == "sdpa":
                step_samples.extend(e["step_s"])
            runs[arm].append(run)
            log(f"[{world} rank(s)] {name} round {r + 1}/{rounds} {arm}: {e['steps']} steps, "
                f"{e['wall_s']:.2f} s, {real / e['wall_s']:.0f} tokens/s")
            del loader, model, opt
    b = fixed_batch_size(cap, lengths)
    out: Dict[str, Any] = {"samples": samples, "mean_length": float(lengths.mean()), "max_length": max_len,
                           "tokens": int(lengths.sum()), "fixed_batch_size": b, **describe(name, full_length),
                           "settings": arm_settings(b, world), "arms": {}}
    for arm, rs in runs.items():
        first = rs[0]
        out["arms"][arm] = {
            "tokens_per_s": _summary(rs), "wall_s": statistics.median(x["wall_s"] for x in rs),
            "loader_s": statistics.median(x["loader_s"] for x in rs),
            "other_threads_cpu_s": statistics.median(x["other_threads_cpu_s"] for x in rs),
            "steps": first["steps"], "real_tokens": first["real_tokens"], "padded_tokens": first["padded_tokens"],
            "token_efficiency": first["real_tokens"] / first["padded_tokens"],
            "tokens_per_step": first["real_tokens"] / (first["steps"] * world),
            "tokens_per_step_vs_cap": first["real_tokens"] / (first["steps"] * world * cap),
            "max_step_padded_tokens": first["max_step_padded_tokens"],
            "saved_mib": first.get("saved_mib"), "peak_mib": first.get("peak_mib"),
            "attention": ATTENTION.get(arm, "sdpa"), "final_loss": first["final_loss"],
            "same_batches_every_round": len({(x["steps"], x["real_tokens"], x["padded_tokens"]) for x in rs}) == 1,
            "steps_equal_on_ranks": all(x["steps_equal_on_ranks"] for x in rs)}
    if step_samples:
        out["step_cost"] = fit_step_cost(step_samples)
    med = {a: m["tokens_per_s"]["median"] for a, m in out["arms"].items()}
    out["odb_over"] = {o: {a: med[o] / med[a] for a in med if a != o} for o in ODB_ARMS if o in med}
    return out


def run_throughput(rank: int, world: int, params: Dict[str, Any]) -> Dict[str, Any]:
    """Every workload of ``params["workloads"]`` ({name: samples}); rank 0's view, reduced over ranks."""
    device = torch.device(params.get("device", "cpu"))
    cap, rounds = int(params["cap"]), int(params["rounds"])
    arms = tuple(params.get("arms", ARMS))

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    full = bool(params.get("full_length"))
    warm_up(device, world, 4096 if full else 1024)
    return {name: run_workload(name, int(n), rank=rank, world=world, device=device, cap=cap, rounds=rounds,
                               arms=arms, full_length=full, log=log)
            for name, n in params["workloads"].items()}
