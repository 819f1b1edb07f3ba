"""Training speed: a tiny causal LM trained under one budget with odb and with what users pick instead.

The model is built from a ``LlamaConfig`` (random init, nothing downloaded). Every arm
sees the same samples once (one epoch over the same dataset) with the same initial
weights; the figure is real (non-pad) tokens per second of wall time, data loading
included, each step timed on its own. Arms:

- ``fixed``: random batches of the largest batch size B whose worst case (B x the
  longest sample) fits the budget, as a trainer without dynamic batching must;
- ``length_grouped``: transformers' ``LengthGroupedSampler`` at that B (what
  ``TrainingArguments(group_by_length=True)`` builds);
- ``batch_rebalance``: transformers' ``BatchRebalanceSampler`` (when the installed
  transformers has it) as ``Trainer`` builds it on one rank, 8 micro-batches per
  optimizer step of 8 x B samples; here every micro-batch is trained as one step, as in
  the other arms;
- ``odb``: ``odb.ODBDataLoader(token_budget=...)``, the loss scaled by the step info.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

from odb import ODBDataLoader, pop_step_info, register_varlen_attention

from .loader_speed import LengthDataset, pad_collate
from .planning import REBALANCE_GRAD_ACCUM, BatchRebalanceSampler, LengthGroupedSampler
from .workloads import lognormal_lengths

VOCAB = 1000
# use_cache=False: no KV cache in training (with one, transformers would not build the block mask of a packed row).
MODEL = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, attn_implementation="sdpa", use_cache=False)


def training_lengths(n: int, max_len: int = 1024, seed: int = 0) -> np.ndarray:
    """The CV 1.0 workload (mean 900) with every length divided by 4, clipped to [16, max_len].

    Dividing keeps the shape of the distribution (CV ~1.0, mean ~216) while making CPU
    training feasible; the clip then touches only ~1% of samples.
    """
    return np.clip(-(-lognormal_lengths(900.0, 1.0, n, seed) // 4), 16, max_len)


def build_model(device: torch.device, max_len: int, seed: int = 0, attn: str = "sdpa") -> torch.nn.Module:
    """The benchmark's Llama; ``attn`` its attention implementation (``"odb_varlen"`` is registered here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if attn == "odb_varlen":
        register_varlen_attention()
    torch.manual_seed(seed)
    config = LlamaConfig(max_position_embeddings=max_len, **{**MODEL, "attn_implementation": attn})
    return LlamaForCausalLM(config).to(device=device, dtype=torch.float32)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Dict[str, torch.Tensor],
          device: torch.device, loss_scale: float) -> float:
    batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    loss = model(**batch).loss
    (loss * loss_scale).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


class Arm:
    """One training arm: its own model, optimizer and loader; steps timed one by one."""

    def __init__(self, name: str, loader: DataLoader, device: torch.device, max_len: int, use_odb: bool,
                 attn: str = "sdpa") -> None:
        self.name, self.device, self.use_odb, self.max_len, self.attn = name, device, use_odb, max_len, attn
        self.model: Optional[torch.nn.Module] = None  # built at the first step, dropped after the last
        self.opt: Optional[torch.optim.Optimizer] = None
        self.batches = iter(loader)
        self.steps_planned = len(loader)
        self.real = self.padded = self.samples = self.steps = 0
        self.seconds = 0.0
        self.losses: List[float] = []
        self.peak_mib = 0.0

    def step(self) -> bool:
        """Fetch one batch and train on it; False at the end of the epoch. Time includes loading."""
        cuda = self.device.type == "cuda"
        if self.model is None:
            self.model = build_model(self.device, self.max_len, attn=self.attn)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        batch = next(self.batches, None)
        if batch is None:
            self.seconds += time.perf_counter() - t0
            self.model = self.opt = None  # on GPU, the next arm's peak memory is then its own
            if cuda:
                torch.cuda.empty_cache()
            return False
        scale = pop_step_info(batch).loss_scale if self.use_odb else 1.0
        self.losses.append(_step(self.model, self.opt, batch, self.device, scale))
        if cuda:
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - t0
        if cuda:
            self.peak_mib = max(self.peak_mib, torch.cuda.max_memory_allocated(self.device) / 2**20)
        mask, positions = batch.get("attention_mask"), batch.get("position_ids")
        if mask is None and positions is not None:  # a padding-free row: samples start where positions restart
            self.real += int(batch["input_ids"].numel())
            self.samples += int((positions == 0).sum())
        else:
            self.real += int(mask.sum())
            self.samples += int(batch["input_ids"].shape[0])
        self.padded += int(batch["input_ids"].numel())
        self.steps += 1
        return True

    def result(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "steps": self.steps, "samples": self.samples, "real_tokens": self.real, "padded_tokens": self.padded,
            "wall_s": self.seconds, "real_tokens_per_s": self.real / self.seconds,
            "token_efficiency": self.real / self.padded, "mean_batch_size": self.samples / max(self.steps, 1),
            "final_loss": float(np.mean(self.losses[-5:]))}
        if self.device.type == "cuda":
            out["peak_memory_mib"] = self.peak_mib
        return out


def run_arms(arms: Sequence[Arm], interleave: bool, progress: Callable[..., Any]) -> None:
    """Run every arm to the end of its epoch.

    Interleaved (CPU): the arm that has consumed fewer samples steps next, so both arms
    cross the epoch side by side and share whatever else loads the machine. Sequential
    (GPU): one arm after the other; an arm's model exists only while it runs, so each
    arm's peak memory is its own.
    """
    def drive() -> Iterator[str]:
        live = list(arms)
        while live:
            arm = min(live, key=lambda a: a.samples) if interleave else live[0]
            if arm.step():
                yield arm.name
            else:
                live.remove(arm)

    for _ in progress(drive(), total=sum(a.steps_planned for a in arms), desc="training", unit="step"):
        pass


def _warm_up(device: torch.device, max_len: int, attn: str = "sdpa") -> None:
    # First-call costs (kernel selection, allocator growth) must not land on either arm.
    model = build_model(device, max_len, seed=1, attn=attn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for b, n in ((4, max_len // 4), (16, 64)):
        ids = torch.randint(1, VOCAB, (b, n))
        _step(model, opt, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}, device, 1.0)
    if attn != "sdpa":  # a packed row too: the attention's own path
        ids = torch.randint(1, VOCAB, (1, max_len))
        positions = torch.arange(max_len).remainder(max_len // 4)[None]
        _step(model, opt, {"input_ids": ids, "position_ids": positions, "labels": ids}, device, 1.0)


ARM_ORDER = ("fixed", "length_grouped", "batch_rebalance", "odb")


def run_training(samples: int, *, device: str = "cpu", budget: int = 4096, max_len: int = 1024,
                 buffer_size: int = 256, threads: Optional[int] = None,
                 progress: Callable[..., Any] = lambda it, **kw: it) -> Dict[str, Any]:
    """Every arm on the same samples, model and budget; tokens/s and odb's speedup over each."""
    dev = torch.device(device)
    if threads is not None and dev.type == "cpu":
        torch.set_num_threads(threads)
    lengths = training_lengths(samples, max_len)
    dataset = LengthDataset(lengths, vocab=VOCAB)
    fixed_b = max(1, budget // int(lengths.max()))
    _warm_up(dev, max_len)
    loaders: Dict[str, DataLoader] = {
        "fixed": DataLoader(dataset, batch_size=fixed_b, shuffle=True, collate_fn=pad_collate,
                            generator=torch.Generator().manual_seed(0))}
    if LengthGroupedSampler is not None:
        sampler = LengthGroupedSampler(fixed_b, lengths=lengths.tolist(), generator=torch.Generator().manual_seed(0))
        loaders["length_grouped"] = DataLoader(dataset, batch_size=fixed_b, sampler=sampler, collate_fn=pad_collate)
    if BatchRebalanceSampler is not None:
        batches = BatchRebalanceSampler(lengths=lengths.tolist(), effective_batch_size=fixed_b * REBALANCE_GRAD_ACCUM,
                                        dp_size=1, grad_accum=REBALANCE_GRAD_ACCUM, seed=0, drop_last=False)
        loaders["batch_rebalance"] = DataLoader(dataset, batch_sampler=batches, collate_fn=pad_collate)
    loaders["odb"] = ODBDataLoader(dataset, token_budget=budget, buffer_size=min(buffer_size, samples),
                                   shuffle=True, seed=0, collate_fn=pad_collate)
    arms = [Arm(name, loader, dev, max_len, name == "odb") for name, loader in loaders.items()]
    interleave = dev.type == "cpu"
    run_arms(arms, interleave, progress)
    res = {arm.name: arm.result() for arm in arms}
    odb_rate = res["odb"]["real_tokens_per_s"]
    speedups = {name: odb_rate / r["real_tokens_per_s"] for name, r in res.items() if name != "odb"}
    return {
        "device": str(dev), "samples": samples, "token_budget": budget, "max_len": max_len,
        "mean_length": float(lengths.mean()), "fixed_batch_size": fixed_b, "odb_buffer_size": min(buffer_size, samples),
        "rebalance_grad_accum": REBALANCE_GRAD_ACCUM, "model": dict(MODEL),
        "threads": torch.get_num_threads() if dev.type == "cpu" else None,
        "arms_interleaved": interleave, "arms": list(res), **res,
        "speedup": speedups["fixed"], "speedups": speedups, "goal_speedup_min": 1.5,
    }
