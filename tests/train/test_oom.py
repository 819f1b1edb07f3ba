"""OOM fallback of a training micro-batch: exact gradients, skip accounting, DDP agreement.

Out-of-memory errors are simulated on CPU (oom_workers.FakeOOM raises torch.OutOfMemoryError
when a pass has more than k rows, in forward or in backward); everything else is real:
float64 models, real autograd accumulation, real DDP over gloo. Gradient error is
max |g - g_ref| / max |g_ref| with g_ref from one unsplit pass (or the single-process
reference of dist_workers for DDP).
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F

import dist_workers
import odb
import oom_workers
from dist_harness import run_ranks
from helpers import IGNORE, make_sample, pad_collate
from odb.train.oom import OOMCounters, PaddedBatchSplitter, train_step_with_oom_fallback
from oom_workers import OOMLM, token_mean_loss

INFO = odb.ODBStepInfo(0, 0, 8, 8, 1, 1, 1, 1, 0.7, False)  # only loss_scale (0.7) and the micro step are read


def lm_batch(rows: int = 8, seed: int = 0) -> Dict[str, Any]:
    """Right-padded rows of 3 to 12 tokens with an attention mask (the splitter trims by it)."""
    lengths = torch.randint(3, 13, (rows,), generator=torch.Generator().manual_seed(seed))
    batch = pad_collate([make_sample(i, int(n)) for i, n in enumerate(lengths)])
    batch["attention_mask"] = (torch.arange(batch["input_ids"].shape[1])[None] < lengths[:, None]).long()
    return batch


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def with_prior_grads(*models: torch.nn.Module) -> None:
    """The same random gradient in every model, as if earlier micro-batches had been accumulated."""
    gen = torch.Generator().manual_seed(7)
    for params in zip(*(m.parameters() for m in models)):
        g = torch.randn(params[0].shape, generator=gen, dtype=params[0].dtype)
        for p in params:
            p.grad = g.clone()


def run_fallback(k: int, where: str, policy: str = "split", batch=None, **kw):
    """(outcome, counters, gradient, reference gradient of one unsplit pass at loss_scale 0.7)."""
    batch = batch if batch is not None else lm_batch()
    ref, model = OOMLM(0, 10**6, where), OOMLM(0, k, where)
    with_prior_grads(ref, model)
    (token_mean_loss(ref, batch) * INFO.loss_scale).backward()
    counters = OOMCounters()
    out = train_step_with_oom_fallback(lambda b: token_mean_loss(model, b), batch, INFO, model=model, policy=policy,
                                       counters=counters, **kw)
    return out, counters, flat_grads(model), flat_grads(ref)


def test_without_oom_it_is_one_plain_pass():
    out, counters, got, ref = run_fallback(10**6, "forward")
    assert (out.action, out.passes, out.local_ooms, out.any_oom, out.exact) == ("ok", 1, 0, False, True)
    assert torch.equal(got, ref)
    assert counters.as_dict() == OOMCounters().as_dict()


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("k,passes,ooms", [(5, 3, 1), (3, 7, 3), (1, 15, 7)])
def test_split_keeps_the_gradient_exact(where, k, passes, ooms):
    out, counters, got, ref = run_fallback(k, where)  # 8 rows: 8 -> 4+4 -> 2x4 -> 1x8
    err = rel_error(got, ref)
    print(f"\nsplit {where} k={k}: {out.passes} passes, relative gradient error {err:.1e}")
    assert err < 1e-12
    assert (out.action, out.passes, out.local_ooms, out.exact, out.skipped_rows) == ("split", passes, ooms, True, 0)
    assert counters.oom_errors == ooms and counters.split_micro_batches == 1 and counters.extra_passes == passes - 1
    with torch.no_grad():
        expected_loss = token_mean_loss(OOMLM(0, 10**6, where), lm_batch()) * INFO.loss_scale
    assert float(out.loss) == pytest.approx(float(expected_loss), rel=1e-12)


def test_a_backward_oom_after_partial_accumulation_is_masked():
    """The head's gradient is added before the fake node raises; without masking it would count twice."""
    model = OOMLM(0, 3, "backward")
    events: List[str] = []
    model.inner[1].weight.register_post_accumulate_grad_hook(lambda p: events.append("head"))
    original = oom_workers.FakeOOM.backward

    def spy(ctx, grad):
        events.append(f"fake {grad.shape[0]}")
        return original(ctx, grad)

    oom_workers.FakeOOM.backward = staticmethod(spy)
    try:
        batch = lm_batch()
        train_step_with_oom_fallback(lambda b: token_mean_loss(model, b), batch, INFO, model=model)
    finally:
        oom_workers.FakeOOM.backward = original
    assert events[:2] == ["head", "fake 8"], events  # partial: the head had its whole-batch gradient
    ref = OOMLM(0, 10**6, "backward")
    (token_mean_loss(ref, batch) * INFO.loss_scale).backward()
    assert rel_error(flat_grads(model), flat_grads(ref)) < 1e-12


def test_skip_drops_a_micro_batch_whose_forward_failed():
    out, counters, got, _ = run_fallback(3, "forward", policy="skip")
    prior = OOMLM(0, 1, "forward")
    with_prior_grads(prior)
    assert torch.equal(got, flat_grads(prior))
    assert (out.action, out.passes, out.skipped_rows, out.exact) == ("skip", 1, 8, True)
    assert (counters.skipped_micro_batches, counters.skipped_rows, counters.oom_errors) == (1, 8, 1)


def test_skip_completes_a_micro_batch_whose_backward_already_reached_some_gradients():
    out, _, got, ref = run_fallback(3, "backward", policy="skip")
    assert rel_error(got, ref) < 1e-12  # cannot be taken back without a copy of the gradient: finished exactly
    assert (out.action, out.exact, out.skipped_rows) == ("split", True, 0)


def test_a_row_that_never_fits_is_dropped_and_flagged_when_it_cannot_be_dropped_exactly():
    out, counters, got, _ = run_fallback(0, "forward")
    prior = OOMLM(0, 1, "forward")
    with_prior_grads(prior)
    assert torch.equal(got, flat_grads(prior)) and (out.action, out.skipped_rows, out.exact) == ("skip", 8, True)
    out, counters, _, _ = run_fallback(0, "backward")
    assert (out.skipped_rows, out.exact, counters.inexact_micro_batches) == (8, False, 1)


def test_pieces_without_supervised_tokens_add_nothing_and_no_nan():
    batch = lm_batch()
    batch["labels"][:4] = IGNORE  # the first half has no loss tokens: a mean over nothing would be NaN
    out, _, got, ref = run_fallback(4, "forward", batch=batch)
    assert out.passes == 3 and torch.isfinite(got).all() and rel_error(got, ref) < 1e-12


def test_a_micro_batch_without_supervised_tokens_adds_an_exact_zero():
    # No supervised token in the whole micro-batch: the token mean is 0 / 0 = NaN and its scale 0. The step must
    # leave the accumulated gradient as it was and report a zero loss, not NaN (NaN x 0 is NaN).
    batch = lm_batch()
    batch["labels"][:] = IGNORE
    info = odb.ODBStepInfo(0, 0, 8, 8, 0, 5, 1, 1, 0.0, False)
    model = OOMLM(0, 10**6, "forward")
    with_prior_grads(model)
    before = flat_grads(model).clone()
    out = train_step_with_oom_fallback(lambda b: token_mean_loss(model, b), batch, info, model=model)
    assert torch.equal(flat_grads(model), before)
    assert out.loss is not None and float(out.loss) == 0.0


def test_padded_splitter_selects_rows_trims_padding_and_weighs_tokens():
    batch = {"input_ids": torch.tensor([[1, 2, 3, 0], [4, 0, 0, 0], [5, 6, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]]),
             "labels": torch.tensor([[1, 2, 3, IGNORE], [4, IGNORE, IGNORE, IGNORE], [IGNORE, 6, IGNORE, IGNORE]]),
             "decoder_input_ids": torch.tensor([[7, 8, 9], [7, 0, 0], [7, 8, 0]]),
             "ids": [10, 11, 12], "note": "kept"}
    s = PaddedBatchSplitter()
    piece = s.take(batch, [1, 2])
    assert piece["input_ids"].tolist() == [[4, 0], [5, 6]] and piece["attention_mask"].shape == (2, 2)
    assert piece["decoder_input_ids"].shape == (2, 3)  # no mask of its width: left as is
    assert piece["ids"] == [11, 12] and piece["note"] == "kept"
    assert (s.rows(batch), s.weight(batch), s.weight(piece)) == (3, 5, 2)
    assert PaddedBatchSplitter(shift_labels=True).weight(batch) == 3  # labels[:, 1:]
    assert s.weight({"input_ids": torch.ones(2, 3)}) == 2  # no labels: rows
    with pytest.raises(TypeError, match="dict batches"):
        s.rows((torch.ones(2, 3),))


class TupleSplitter:
    """A custom splitter for (inputs, labels) tuples."""

    def rows(self, batch):
        return len(batch[0])

    def take(self, batch, rows):
        return tuple(t[list(rows)] for t in batch)

    def weight(self, piece):
        return int((piece[1] != IGNORE).sum())


def test_a_custom_splitter_serves_other_batch_types():
    batch = lm_batch()
    pair = (batch["input_ids"], batch["labels"])
    ref, model = OOMLM(0, 10**6, "forward"), OOMLM(0, 2, "forward")
    token_mean_loss(ref, batch).mul(0.7).backward()
    out = train_step_with_oom_fallback(lambda b: token_mean_loss(model, {"input_ids": b[0], "labels": b[1]}), pair,
                                       INFO, model=model, splitter=TupleSplitter())
    assert out.passes == 7 and rel_error(flat_grads(model), flat_grads(ref)) < 1e-12


def test_hf_causal_lm_split_with_trimmed_padding_is_exact():
    """A tiny Llama in float64, right-padded rows trimmed per piece, labels shifted as HF does."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).double()
    model = transformers.LlamaForCausalLM(cfg).double()
    model.load_state_dict(ref.state_dict())
    batch = {k: v for k, v in lm_batch(6, seed=3).items() if k in ("input_ids", "attention_mask", "labels")}
    rows_seen: List[int] = []

    def fake_limit(module, args, kwargs):
        rows_seen.append(kwargs["input_ids"].shape[0])
        if kwargs["input_ids"].shape[0] > 2:
            raise torch.OutOfMemoryError("fake: more than 2 rows")

    def loss_of(m, b):  # HF's own loss casts logits to float32; this is the same mean in float64
        logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, 50), b["labels"][:, 1:].reshape(-1), ignore_index=IGNORE)

    model.register_forward_pre_hook(fake_limit, with_kwargs=True)
    loss_of(ref, batch).mul(0.7).backward()
    out = train_step_with_oom_fallback(lambda b: loss_of(model, b), batch, INFO, model=model,
                                       splitter=PaddedBatchSplitter(shift_labels=True))
    err = max(rel_error(p.grad.reshape(-1), q.grad.reshape(-1)) for p, q in zip(model.parameters(), ref.parameters()))
    print(f"\nHF Llama split 6 rows -> pieces {rows_seen}: relative gradient error {err:.1e}")
    assert out.action == "split" and rows_seen == [6, 3, 3, 1, 2, 1, 2] and err < 1e-12


@pytest.mark.parametrize("kwargs,match", [(dict(policy="retry"), "policy='retry'"),
                                          (dict(sync_pass="first"), "sync_pass='first'")])
def test_bad_options_are_named(kwargs, match):
    model = OOMLM(0, 10**6, "forward")
    with pytest.raises(ValueError, match=match):
        train_step_with_oom_fallback(lambda b: token_mean_loss(model, b), lm_batch(), INFO, model=model, **kwargs)
    with pytest.raises(ValueError, match="0 rows"):
        train_step_with_oom_fallback(lambda b: b, {"input_ids": torch.ones(0, 3)}, INFO, model=model)


# ---- real DDP over gloo ------------------------------------------------------------------------

DDP_PARAMS = dict(counts=[40, 40], budget=256, buffer=16, seed=0, oom_rank=1)


def reference(ids: List[int], kept: List[int]) -> List[torch.Tensor]:
    """Gradient of (sum of token losses over ``kept``) / (supervised tokens of ``ids``), one process."""
    lengths = dist_workers.grad_lengths(2, DDP_PARAMS)
    model = dist_workers.lm_model(DDP_PARAMS["seed"])
    total = int((pad_collate([make_sample(i, lengths[i]) for i in ids])["labels"] != IGNORE).sum())
    if kept:
        (dist_workers.lm_loss(model, pad_collate([make_sample(i, lengths[i]) for i in kept]), "sum") / total).backward()
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def check_ddp_run(per_rank: List[Dict[str, Any]], policy: str) -> float:
    """Same passes on both ranks, every sample once, synced gradient = reference; returns the worst error."""
    steps = [r["steps"] for r in per_rank]
    assert len(steps[0]) == len(steps[1]) >= 4
    worst, seen = 0.0, []
    for s0, s1 in zip(*steps):
        assert [m["passes"] for m in s0["micro"]] == [m["passes"] for m in s1["micro"]]
        assert [m["any_oom"] for m in s0["micro"]] == [m["any_oom"] for m in s1["micro"]]
        for a, b in zip(s0["grads"], s1["grads"]):
            assert torch.allclose(a, b, rtol=0, atol=1e-14)
        micro = s0["micro"] + s1["micro"]
        ids = [i for m in micro for i in m["ids"]]
        kept = [i for m in micro if not m["skipped"] for i in m["ids"]]
        seen += ids
        ref = reference(ids, kept)
        worst = max(worst, max(float((g - f).abs().max()) for g, f in zip(s0["grads"], ref))
                    / max(max(float(f.abs().max()) for f in ref), 1e-300))
    assert sorted(seen) == list(range(sum(DDP_PARAMS["counts"])))
    c0, c1 = (r["counters"] for r in per_rank)
    assert c0["oom_errors"] == 0 and c1["oom_errors"] > 0
    assert c0["micro_batches_with_oom"] == c1["micro_batches_with_oom"] > 0
    assert c0["extra_passes"] == c1["extra_passes"]
    if policy == "skip":
        assert c1["skipped_rows"] > 0 and c0["skipped_rows"] == 0
    return worst


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_ddp_one_rank_runs_out_of_memory_the_other_never_hangs(tmp_path):
    scenarios = [dict(where="forward", sync_pass="last", policy="split", accumulation=1, k=3),
                 dict(where="forward", sync_pass="last", policy="split", accumulation=3, k=3),
                 dict(where="backward", sync_pass="extra", policy="split", accumulation=1, k=3),
                 dict(where="backward", sync_pass="extra", policy="split", accumulation=3, k=2),
                 dict(where="forward", sync_pass="last", policy="skip", accumulation=2, k=3),
                 dict(where="forward", sync_pass="last", policy="split", accumulation=2, k=3, ddp=False)]
    results = run_ranks("oom_workers:ddp_oom", 2, dict(DDP_PARAMS, scenarios=scenarios), tmp_path, deadline_s=150)
    for n, sc in enumerate(scenarios):
        per_rank = [r[n] for r in results]
        worst = check_ddp_run(per_rank, sc["policy"])
        positions = {(k, k == len(step["micro"]) - 1) for step in per_rank[1]["steps"]
                     for k, m in enumerate(step["micro"]) if m["ooms"]}
        if sc["accumulation"] > 1:  # OOMs in syncing and in non-syncing micro-steps (DDP state differs)
            assert {last for _, last in positions} == {True, False}
        c = per_rank[1]["counters"]
        print(f"\nDDP {sc}: max relative gradient error {worst:.1e}; rank 1 {c}")
        assert worst < 1e-12


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_ddp_oom_inside_a_syncing_backward_raises_a_named_error(tmp_path):
    said = run_ranks("oom_workers:sync_backward_oom", 2, {}, tmp_path, deadline_s=90)
    assert said[1].startswith("ODBOOMError") and "sync_pass='extra'" in said[1]
    assert said[0] != "finished"  # rank 0 learned of it from gloo instead of waiting forever
