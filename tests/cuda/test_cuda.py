"""What only a CUDA device can show: the native packed-row kernel, pinned batches, the auto budget under a
real allocator and a real out-of-memory error. Skipped without CUDA (CI has no GPU); run on a GPU machine:

    python -m pytest -q tests/cuda

Each test compares with a reference computed on the same device, so a wrong kernel call, a lost sample,
a budget over its cap or an inexact OOM split fails.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F

import odb
from odb.bench.loader_speed import pad_collate  # right-padded ids, attention_mask, labels -100 on padding

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
DEV = "cuda"


def _alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: List[int]) -> torch.Tensor:
    """Each sample's causal attention on its own, in float32 (the reference)."""
    reps = q.shape[-3] // k.shape[-3]
    q, k, v = q.float(), k.repeat_interleave(reps, dim=-3).float(), v.repeat_interleave(reps, dim=-3).float()
    return torch.cat([F.scaled_dot_product_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], is_causal=True)
                      for a, b in zip(bounds, bounds[1:])], dim=-2)


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_packed_rows_use_the_native_kernel_and_equal_each_sample_alone(kv_heads: int) -> None:
    from odb.packed.attention import native_varlen

    torch.manual_seed(0)
    bounds = [0, 37, 38, 300, 555, 1024]
    q = torch.randn(1, 8, 1024, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv_heads, 1024, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv_heads, 1024, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    has_kernel = importlib.util.find_spec("torch.nn.attention.varlen") is not None
    assert (native_varlen(q) is not None) == has_kernel  # bf16 on CUDA takes the kernel where torch has it
    out = odb.varlen_causal_attention(q, k, v, bounds)
    ref = _alone(q, k, v, bounds)
    assert (out.float() - ref).abs().max().item() < 2e-2
    w = torch.randn_like(ref)
    got = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, r in zip(got, want):
        assert ((g.float() - r).norm() / r.norm()).item() < 2e-2


def test_float32_queries_under_bf16_autocast_take_the_native_kernel() -> None:
    """A Llama's rotary embedding hands float32 queries to attention under bf16 autocast; odb_varlen casts
    them as autocast casts sdpa's inputs, so the row takes the kernel (bf16 out) and equals each sample."""
    torch.manual_seed(0)
    bounds = [0, 100, 101, 512]
    q, k, v = (torch.randn(1, 4, 512, 64, device=DEV) for _ in range(3))
    with torch.autocast(DEV, dtype=torch.bfloat16):
        out = odb.varlen_causal_attention(q, k, v, bounds)
    has_kernel = importlib.util.find_spec("torch.nn.attention.varlen") is not None
    assert out.dtype == torch.bfloat16
    ref = _alone(q.bfloat16(), k.bfloat16(), v.bfloat16(), bounds)
    assert (out.float() - ref).abs().max().item() < 2e-2
    if has_kernel:
        from odb.packed import attention

        calls = []
        real = attention.native_varlen
        try:
            attention.native_varlen = lambda x, *rest: calls.append(x.dtype) or real(x, *rest)
            with torch.autocast(DEV, dtype=torch.bfloat16):
                odb.varlen_causal_attention(q, k, v, bounds)
        finally:
            attention.native_varlen = real
        assert calls == [torch.bfloat16]


def _llama(attn: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if attn == "odb_varlen":
        odb.register_varlen_attention()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                         attn_implementation=attn, use_cache=False)
    return LlamaForCausalLM(config).to(DEV)


def test_a_packed_llama_row_gives_each_samples_logits_in_bf16() -> None:
    """odb_varlen over one packed row (PackedCollate) against sdpa on each sample alone, bf16 autocast."""
    torch.manual_seed(1)
    lengths = [5, 120, 33, 400, 1]
    samples = [{"input_ids": torch.randint(0, 512, (n,)), "labels": torch.randint(0, 512, (n,))} for n in lengths]
    row = odb.PackedCollate()(samples)
    packed, plain = _llama("odb_varlen"), _llama("sdpa")
    plain.load_state_dict(packed.state_dict())
    with torch.no_grad(), torch.autocast(DEV, dtype=torch.bfloat16):
        got = packed(**{k: v.to(DEV) for k, v in row.items() if isinstance(v, torch.Tensor) and k != "labels"}).logits
        want = torch.cat([plain(input_ids=s["input_ids"][None].to(DEV)).logits for s in samples], dim=1)
    assert got.shape == want.shape
    assert (got.float() - want.float()).abs().max().item() < 5e-2 * max(1.0, want.float().abs().max().item())


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, lengths: List[int]) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = [torch.randint(1, 512, (n,), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return {"input_ids": self.items[i], "labels": self.items[i].clone()}


@pytest.mark.timeout(300)
def test_pinned_batches_from_workers_give_the_whole_data_gradient_on_cuda() -> None:
    """num_workers=2, pin_memory=True: batches arrive pinned, and the scaled micro-batch losses of an epoch
    (one optimizer step) sum to the gradient of the mean loss over every supervised token (float64)."""
    torch.manual_seed(0)
    lengths = [int(n) for n in torch.randint(4, 200, (160,))]
    data = _Tokens(lengths)
    model = torch.nn.Sequential(torch.nn.Embedding(512, 32), torch.nn.Linear(32, 512)).to(DEV, torch.float64)

    def token_loss(batch: Dict[str, Any], reduction: str) -> torch.Tensor:
        logits = model(batch["input_ids"].to(DEV, non_blocking=True))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].to(DEV).flatten(), reduction=reduction)

    full = pad_collate([data[i] for i in range(len(data))])
    want = torch.autograd.grad(token_loss(full, "mean"), list(model.parameters()))
    loader = odb.ODBDataLoader(data, token_budget=1024, num_workers=2, pin_memory=True, collate_fn=pad_collate,
                               shift_labels=False, gradient_accumulation_steps=10**6, shuffle=True, seed=3)
    seen: List[int] = []
    for batch in loader:
        info = odb.pop_step_info(batch)
        assert batch["input_ids"].is_pinned()
        odb.scale_loss(token_loss(batch, "mean"), info).backward()
        seen.extend(info.sample_ids)
    assert sorted(seen) == list(range(len(data)))
    for p, w in zip(model.parameters(), want):
        assert torch.allclose(p.grad, w, rtol=1e-9, atol=1e-12)


@pytest.mark.timeout(300)
def test_auto_budget_learns_the_cuda_peak_and_keeps_every_step_under_its_cap() -> None:
    """token_budget="auto" with the default meter (CudaPeakMeter): a cap worth ~6x the activations of a
    512-token sample; every step's peak (torch.cuda.max_memory_allocated) stays under it, and the fitted
    budget grows past the first windows' guess."""
    model = _llama("sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch: Dict[str, Any], scale: float = 1.0) -> None:
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = model(**{k: v.to(DEV) for k, v in batch.items()}).loss
        (loss * scale).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    probe = pad_collate([_Tokens([512])[0]])
    step(probe)  # optimizer state exists: what stays allocated between steps
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(probe)
    one = torch.cuda.max_memory_allocated() - resident
    cap = resident + 6 * one
    torch.manual_seed(0)
    data = _Tokens([int(n) for n in torch.randint(16, 512, (1500,))])
    loader = odb.ODBDataLoader(data, token_budget="auto", memory_cap_bytes=cap, collate_fn=pad_collate, shuffle=True,
                               shift_labels=True)
    peaks, padded = [], []
    for batch in loader:
        info = odb.pop_step_info(batch)
        step(batch, info.loss_scale)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())  # this step's peak: the loader resets it at next()
        padded.append(info.padded_tokens)
    assert len(peaks) > 20
    assert max(peaks) <= cap, (max(peaks), cap)
    late = padded[len(padded) // 2:]
    assert sum(late) / len(late) > 1024  # the budget grew well past one 512-token sample
    assert loader.odb_stats["auto_observed_steps"] == len(peaks)


@pytest.mark.timeout(300)
def test_a_real_cuda_out_of_memory_error_is_split_and_the_gradient_stays_exact() -> None:
    """A per-process memory cap makes the whole micro-batch run out of CUDA memory (about 12 GiB of
    activations and their gradients against 9 GiB allowed); the fallback reruns it in halves and the
    gradient equals the one computed in quarters without a cap."""
    from odb.train.oom import OOMCounters, train_step_with_oom_fallback

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 65536), torch.nn.ReLU(), torch.nn.Linear(65536, 1)).to(DEV)
    rows = 16384
    batch = {"x": torch.randn(rows, 256, device=DEV), "y": torch.randn(rows, 1, device=DEV)}

    def loss_fn(b: Dict[str, torch.Tensor]) -> torch.Tensor:
        return ((model(b["x"]) - b["y"]) ** 2).mean()

    for part in range(4):  # the reference: quarters, each a quarter of the mean
        piece = {k: v[part * rows // 4:(part + 1) * rows // 4] for k, v in batch.items()}
        (loss_fn(piece) / 4).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    allowed = torch.cuda.memory_reserved() + 9 * 2**30
    info = odb.ODBStepInfo(micro_batch=0, epoch=0, local_samples=rows, all_samples_this_step=rows, local_loss_tokens=rows,
                           global_loss_tokens=rows, real_tokens=rows, padded_tokens=rows, loss_scale=1.0,
                           is_ghost=False)
    counters = OOMCounters()
    torch.cuda.set_per_process_memory_fraction(allowed / total)
    try:
        outcome = train_step_with_oom_fallback(loss_fn, batch, info, model=model, counters=counters)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert outcome.local_ooms >= 1 and outcome.action == "split", outcome
    assert counters.oom_errors >= 1 and counters.inexact_micro_batches == 0
    for p, w in zip(model.parameters(), want):
        assert torch.allclose(p.grad, w, rtol=1e-4, atol=1e-7), (p.grad - w).abs().max()
