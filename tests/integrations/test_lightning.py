"""odb under PyTorch Lightning: Trainer.fit with ddp_spawn on 2 CPU processes (gloo), uneven shards.

Rank 0 holds most of the samples and rank 1 a few, so rank 1 runs ghost steps: fit must
end cleanly (no Join), both ranks must train the same number of batches, every sample
once per epoch across the ranks, and with exact scaling (accumulate_grad_batches=2) the
float64 parameters after every optimizer step must equal one process stepping over the
union of that step's samples. A run stopped by a mid-epoch checkpoint and resumed from it
must train exactly the remaining batches. Each rank writes what it saw to a file
(integration_workers.LitLM); the test reads both.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List

import pytest
import torch

import integration_workers as iw
import lightning.pytorch  # noqa: F401  (pinned under `make test` and test-min: a broken install fails, never skips)
from dist_harness import free_port
from helpers import known_lengths
from odb.integrations.lightning import ODBLightningLoader

pytestmark = pytest.mark.timeout(150)

LENGTHS = known_lengths(36, 3, 30, seed=11)
SIZES = [30, 6]  # rank 0: samples 0-29, rank 1: samples 30-35
ACCUMULATION = 2  # accumulate_grad_batches; the epochs end in shorter windows too


def fit(tmp_path, monkeypatch, **overrides: Any) -> List[Dict[str, Any]]:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # Lightning would reuse one port for every test
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    p = dict(world=2, lengths=LENGTHS, sizes=SIZES, budget=96, buffer=12, seed=4, lr=0.5, epochs=2,
             accumulation=ACCUMULATION, out=str(out))
    p.update(overrides)
    iw.lightning_fit(p)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def epoch_ids(micro: List[Dict[str, Any]], epoch: int) -> List[int]:
    return [i for m in micro if m["epoch"] == epoch for i in m["ids"]]


def check_run(ranks: List[Dict[str, Any]], accumulation: int) -> None:
    """Equal steps, exactly-once shards, ghosts on the short rank, optimizer steps where odb's end, exactness."""
    micro = [r["micro"] for r in ranks]
    assert len(micro[0]) == len(micro[1]) > 0, f"ranks trained {len(micro[0])} and {len(micro[1])} batches"
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == len(ranks[0]["steps"])
    for epoch in range(2):
        assert sorted(epoch_ids(micro[0], epoch) + epoch_ids(micro[1], epoch)) == list(range(len(LENGTHS)))
        for rank, size in enumerate(SIZES):  # each rank trained exactly its own shard
            start = sum(SIZES[:rank])
            assert sorted(epoch_ids(micro[rank], epoch)) == list(range(start, start + size))
    ghosts = [sum(m["ghost"] for m in rank_micro) for rank_micro in micro]
    assert ghosts[0] == 0 and ghosts[1] > 0, f"ghost steps per rank: {ghosts}"
    for rank_micro in micro:
        assert [m["stepped"] for m in rank_micro] == [m["last"] for m in rank_micro], \
            "Lightning stepped the optimizer where odb's optimizer step does not end"
    for rank, rank_micro in enumerate(micro):  # the step info belongs to the batch being trained
        assert all([i + sum(SIZES[:rank]) for i in m["info_ids"]] == m["ids"] for m in rank_micro)
    assert any(not m["stepped"] for m in micro[0]) == (accumulation > 1)
    steps = [r["steps"] for r in ranks]
    reference = iw.reference_run(LENGTHS, [sorted(a["ids"] + b["ids"]) for a, b in zip(*steps)], 4, 0.5)
    before = [q.detach() for q in iw.lm_model(4).parameters()]
    error = 0.0
    for s0, s1, ref in zip(*steps, reference):
        assert all(torch.equal(a, b) for a, b in zip(s0["params"], s1["params"])), "DDP replicas diverged"
        update = max(float((r - b).abs().max()) for r, b in zip(ref, before))
        error = max(error, max(float((g - r).abs().max()) for g, r in zip(s0["params"], ref)) / update)
        before = ref
    print(f"lightning ddp_spawn, 2 processes, accumulate_grad_batches={accumulation}: {len(reference)} optimizer "
          f"steps, ghost steps per rank {ghosts}, max relative parameter-update error {error:.2e}")
    assert error < 1e-6
    # epoch metrics are logged over all ranks: means of the ranks' means, ghost steps and tokens/s summed
    last = [[m for m in r["micro"] if m["epoch"] == 1] for r in ranks]
    for r in ranks:
        metrics = r["metrics"]
        assert metrics["odb/ghost_steps"] == sum(m["ghost"] for rank_last in last for m in rank_last)
        for name, field in (("odb/batch_size_epoch", "local"), ("odb/padding_ratio_epoch", "padding")):
            want = sum(sum(m[field] for m in rank_last) / len(rank_last) for rank_last in last) / len(last)
            assert metrics[name] == pytest.approx(want), name
        for name in ("odb/real_tokens_per_s_epoch", "odb/samples_per_s_epoch"):
            assert math.isfinite(metrics[name]) and metrics[name] > 0, (name, metrics)
        assert metrics["odb/rank_imbalance_epoch"] >= 1.0 and metrics["odb/loader_wait_s_epoch"] >= 0.0
        assert {"odb/padding_ratio", "odb/batch_size", "odb/samples_per_s"} <= set(metrics)  # per step


def test_fit_with_uneven_shards_and_accumulation_is_exact_and_resumes_mid_epoch_exactly(tmp_path, monkeypatch):
    full = fit(tmp_path / "full", monkeypatch)
    check_run(full, ACCUMULATION)
    order = [[i for m in full[0]["micro"] if m["epoch"] == e for i in m["ids"]] for e in (0, 1)]
    assert order[0] != order[1], "the epochs did not reshuffle: set_epoch did not reach odb"
    # A checkpoint 2 optimizer steps into epoch 1, with an odb state taken every 3 batches: it holds the state
    # before the last multiple of 3 and replays the batches trained since (never the one fetched ahead).
    at = sum(m["stepped"] for m in full[0]["micro"] if m["epoch"] == 0) + 2
    ckpt = str(tmp_path / "mid.ckpt")
    first = fit(tmp_path / "first", monkeypatch, max_steps=at, checkpoint_at=at, checkpoint=ckpt, snapshot_every=3)
    rest = fit(tmp_path / "rest", monkeypatch, resume_from=ckpt, snapshot_every=3)
    replay = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["replay"]
    assert replay == sum(m["epoch"] == 1 for m in first[0]["micro"]) % 3 > 0
    for rank in range(2):
        assert len(first[rank]["steps"]) == at
        done = [m["ids"] for m in first[rank]["micro"]]
        resumed = [m["ids"] for m in rest[rank]["micro"]]
        assert done + resumed == [m["ids"] for m in full[rank]["micro"]], f"rank {rank} did not continue exactly"
        assert rest[rank]["global_step"] == full[rank]["global_step"]
        for got, want in zip(rest[rank]["steps"][-1]["params"], full[rank]["steps"][-1]["params"]):
            assert torch.allclose(got, want, rtol=0, atol=1e-12)


def fit_here(tmp_path, trainer_accumulation: int = 1, callback: bool = True, **overrides: Any) -> Any:
    """One process, in this one (no strategy launches anything)."""
    import lightning.pytorch as pl

    from odb.integrations.lightning import ODBCallback

    p = dict(lengths=LENGTHS, budget=96, buffer=12, seed=4, lr=0.5, accumulation=1, out=str(tmp_path))
    p.update(overrides)
    module = iw.LitLM(p)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=trainer_accumulation,
                         callbacks=[ODBCallback(budget_filled_steps=not p.get("global_batch"))] if callback else [],
                         logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    return module, trainer


def test_single_process_epoch_runs_to_odbs_last_batch_not_to_the_length_estimate(tmp_path):
    module, trainer = fit_here(tmp_path)
    loader = trainer.train_dataloader.loader
    assert loader.odb_stats["steps"] == len(module.micro) == trainer.global_step
    assert sorted(i for m in module.micro for i in m["ids"]) == list(range(len(LENGTHS)))
    # len() before an epoch is an estimate (close, not exact): Lightning would cut the epoch there, so the
    # wrapper hides it and the epoch ends at odb's last batch, as asserted above.
    estimate = len(iw.LitLM(module.p).train_dataloader().loader)
    assert abs(estimate - len(module.micro)) <= max(1, 0.1 * len(module.micro))


def test_misconfigurations_raise_with_a_fix(tmp_path):
    with pytest.raises(ValueError, match="gradient_accumulation_steps=1 but the Trainer accumulates 2.*Fix"):
        fit_here(tmp_path, trainer_accumulation=2)
    with pytest.raises(ValueError, match="without ODBLightningLoader.*Fix: return ODBLightningLoader"):
        fit_here(tmp_path, raw_loader=True)
    with pytest.raises(RuntimeError, match="no ODBStepInfo.*Fix: Trainer\\(callbacks=\\[ODBCallback"):
        fit_here(tmp_path, callback=False)
    with pytest.raises(TypeError, match="not an odb loader"):
        ODBLightningLoader(torch.utils.data.DataLoader(list(range(4))))


def test_global_batch_size_keeps_the_users_steps_under_automatic_and_manual_optimisation(tmp_path):
    """A global_batch_size given alone (no batch_size) under automatic optimisation (Lightning steps where odb's
    steps end: tests/integrations/test_lightning_batch.py) and under manual optimisation (the module steps at
    is_last_micro_step): steps of 6 samples in several micro-batches, each equal to one SGD step over them."""
    n = len(LENGTHS)
    for manual in (False, True):
        out = tmp_path / ("manual" if manual else "automatic")
        out.mkdir()
        module, trainer = fit_here(out, global_batch=6, manual=manual)
        assert [len(s["ids"]) for s in module.steps] == [6] * (n // 6) + ([n % 6] if n % 6 else [])
        assert trainer.global_step == len(module.steps)
        assert any(m["last"] is False for m in module.micro)  # steps of several micro-batches
        assert [m["stepped"] for m in module.micro] == [m["last"] for m in module.micro]
        reference = iw.reference_run(LENGTHS, [sorted(s["ids"]) for s in module.steps], 4, 0.5)
        for got, ref in zip([s["params"] for s in module.steps], reference):
            assert max(float((g - r).abs().max()) for g, r in zip(got, ref)) < 1e-9


def test_loader_state_is_the_first_untrained_batch_while_one_batch_is_fetched_ahead():
    import odb
    from helpers import LengthDataset, pad_collate

    def build() -> ODBLightningLoader:
        data = LengthDataset(LENGTHS)
        return ODBLightningLoader(odb.ODBDataLoader(data, token_budget=96, buffer_size=8, first_window_size=4,
                                                    shuffle=True, seed=3, collate_fn=pad_collate), snapshot_every=3)

    whole = build()
    epochs = [[list(b["idx"]) for b in whole] for _ in range(2)]
    n = len(epochs[0])
    for trained in (0, 1, 3, 4, n - 1, n):  # replays 0, 1, 0, 1, ..., and the epoch's end
        wrapper = build()
        batches = iter(wrapper)
        ahead, done = [next(batches)], []
        for _ in range(trained):  # like Lightning: hand out a step info, train, fetch the next batch
            wrapper.next_step_info()
            done.append(list(ahead.pop(0)["idx"]))
            ahead += [b for b in [next(batches, None)] if b is not None]
        state = wrapper.state_dict()
        resumed = build()
        resumed.load_state_dict(state)
        rest = [list(b["idx"]) for b in resumed]
        want = epochs[0][trained:] if trained < n else epochs[1]
        assert done == epochs[0][:trained] and rest == want, f"after {trained} trained batches"
        assert state["replay"] == (trained % 3 if trained < n else 0)


def test_a_training_step_without_scale_loss_is_warned_once_with_the_fix(tmp_path, recwarn):
    import lightning.pytorch as pl

    from odb.integrations.lightning import ODBCallback
    from odb.step_info import StepInfoNotPoppedWarning

    class Unscaled(iw.LitLM):
        def training_step(self, batch, batch_idx):
            return iw.lm_loss(self.model, batch)  # the batch's mean loss, never scaled by odb

        def on_train_batch_end(self, outputs, batch, batch_idx):
            pass  # LitLM's records need its training_step

    def run(module: Any) -> List[Any]:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2,
                             callbacks=[ODBCallback(budget_filled_steps=True)], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        recwarn.clear()
        trainer.fit(module)
        return [w for w in recwarn.list if issubclass(w.category, StepInfoNotPoppedWarning)]

    p = dict(lengths=LENGTHS, budget=96, buffer=12, seed=4, lr=0.5, accumulation=1, out=str(tmp_path))
    [warning] = run(Unscaled(p))
    assert "Unscaled.training_step trained a batch (epoch 0, step 0) without calling" in str(warning.message)
    assert "return scale_loss(self, self.model(**batch).loss)" in str(warning.message)
    assert run(iw.LitLM(p)) == [], "a training_step that scales its loss is not warned about"


class PackedLlama(lightning.pytorch.LightningModule):
    """A tiny HF Llama (sdpa, the default attention) trained on packed rows through ODBLightningLoader."""

    def __init__(self) -> None:
        super().__init__()
        from packed_workers import tiny_llama

        self.model = tiny_llama("sdpa")

    def train_dataloader(self):
        import odb
        from helpers import LengthDataset

        data = LengthDataset(known_lengths(24, 3, 20, seed=2))
        return ODBLightningLoader(odb.ODBDataLoader(data, token_budget=64, layout="packed", buffer_size=12,
                                                    collate_fn=odb.PackedCollate(), seed=0, shift_labels=True))

    def training_step(self, batch, batch_idx):
        from odb.integrations.lightning import scale_loss

        batch = {k: batch[k] for k in ("input_ids", "position_ids", "labels") if k in batch}
        return scale_loss(self, self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("packed_attention", ["odb_varlen", "model"])
def test_packed_rows_switch_the_models_dense_mask_attention_to_odb_varlen(packed_attention, caplog):
    """A packed-row loader under Lightning: ODBCallback switches the module's sdpa model to odb_varlen and says
    so once, as the HF/TRL integrations do (it trained on the dense mask, silently slower, before);
    packed_attention="model" keeps sdpa."""
    import logging

    import lightning.pytorch as pl

    from odb.integrations.lightning import ODBCallback

    module = PackedLlama()
    callback = ODBCallback(packed_attention=packed_attention, budget_filled_steps=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=[callback],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with caplog.at_level(logging.WARNING, logger="odb.packed.models"):
        trainer.fit(module)
    switched = [r for r in caplog.records if "switched from 'sdpa' to 'odb_varlen'" in r.getMessage()]
    if packed_attention == "odb_varlen":
        assert module.model.config._attn_implementation == "odb_varlen" and len(switched) == 1
    else:
        assert module.model.config._attn_implementation == "sdpa" and not switched
    assert trainer.global_step > 0
