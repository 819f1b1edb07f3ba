"""Loss scaling: the scaled micro-batch losses of an optimizer step give the gradient of one pass.

Single process, float64. The model returns the mean loss over its batch's supervised
tokens (labels != -100); the trainer multiplies it by info.loss_scale. The reference
recollates the union of the optimizer step's samples and takes the mean over all of
their supervised tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import odb
from helpers import IGNORE, LengthDataset, known_lengths, pad_collate

VOCAB = 50
LENGTHS = known_lengths(70, 3, 20, seed=5)  # >= 3 tokens: labels[2] is supervised even when shifted
DATA = LengthDataset(LENGTHS)


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8, dtype=torch.float64)
        self.head = torch.nn.Linear(8, VOCAB, dtype=torch.float64)

    def token_losses(self, batch, shift: bool = False) -> torch.Tensor:
        """Per-token losses, (rows, positions), 0 where the label is ignored."""
        logits, labels = self.head(self.embed(batch["input_ids"])), batch["labels"]
        if shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        flat = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE, reduction="none")
        return flat.view(labels.shape)

    def token_mean_loss(self, batch, shift: bool = False) -> torch.Tensor:
        labels = batch["labels"][:, 1:] if shift else batch["labels"]
        return self.token_losses(batch, shift).sum() / (labels != IGNORE).sum()

    def sample_mean_loss(self, batch) -> torch.Tensor:
        per_sample = self.token_losses(batch).sum(1) / (batch["labels"] != IGNORE).sum(1)
        return per_sample.mean()


def grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def optimizer_steps(loader, model, loss_of):
    """Runs the loader like a trainer; yields (step infos, accumulated grads, sample ids) per optimizer step."""
    infos, ids = [], []
    model.zero_grad()
    for batch in loader:
        info = odb.pop_step_info(batch)
        (loss_of(model, batch) * info.loss_scale).backward()
        infos.append(info)
        ids.extend(batch["idx"])
        if info.is_last_micro_step:
            yield infos, grads(model).clone(), ids
            infos, ids = [], []
            model.zero_grad()
    assert not infos, "an epoch ended inside an optimizer step"


def make_loader(**options):
    return odb.ODBDataLoader(DATA, token_budget=64, buffer_size=16, collate_fn=pad_collate, shuffle=True,
                             seed=0, **options)


def union(ids):
    return pad_collate([DATA[i] for i in ids])


@pytest.mark.parametrize("mode", ["exact", "approx"])
@pytest.mark.parametrize("accumulation", [1, 4])  # 15 micro-batches: the last of 4 optimizer steps holds 3
@pytest.mark.parametrize("shift", [False, True])
def test_token_mean_gradient_is_exact(mode, accumulation, shift):
    model = TinyLM()
    loader = make_loader(gradient_accumulation_steps=accumulation, loss_scaling=mode, shift_labels=shift)
    steps = list(optimizer_steps(loader, model, lambda m, b: m.token_mean_loss(b, shift)))
    seen = sorted(i for _, _, ids in steps for i in ids)
    assert seen == list(range(len(LENGTHS)))
    for infos, got, ids in steps:
        assert [i.micro_step for i in infos] == list(range(len(infos)))
        assert all(i.micro_steps == len(infos) <= accumulation for i in infos)
        ref_batch = union(ids)
        supervised = ref_batch["labels"][:, 1:] if shift else ref_batch["labels"]
        assert infos[0].global_loss_tokens == int((supervised != IGNORE).sum())
        model.zero_grad()
        model.token_mean_loss(ref_batch, shift).backward()
        assert rel_error(got, grads(model)) < 1e-9
    # Every window but the last is full; the last holds what is left, and is normalised by that.
    assert all(len(infos) == accumulation for infos, _, _ in steps[:-1])
    if accumulation == 4:
        assert len(steps[-1][0]) < accumulation, "choose the data so the last window is partial"


def test_shift_labels_counts_labels_after_the_first():
    for shift in (False, True):
        for batch in make_loader(shift_labels=shift):
            info = odb.pop_step_info(batch)
            expected = sum(int((DATA[i]["labels"][1 if shift else 0:] != IGNORE).sum()) for i in batch["idx"])
            assert info.local_loss_tokens == expected
    # make_sample supervises label 0, so the shifted count is smaller by one per sample
    batch = next(iter(make_loader(shift_labels=True)))
    plain_info = odb.pop_step_info(next(iter(make_loader(shift_labels=False))))
    assert odb.pop_step_info(batch).local_loss_tokens == plain_info.local_loss_tokens - len(plain_info.sample_ids)


@pytest.mark.parametrize("accumulation", [1, 3])
def test_sample_mode_averages_over_samples(accumulation):
    model = TinyLM()
    loader = make_loader(gradient_accumulation_steps=accumulation, loss_scaling="sample")
    steps = list(optimizer_steps(loader, model, lambda m, b: m.sample_mean_loss(b)))
    assert len(steps) > 1
    for infos, got, ids in steps:
        assert sum(i.local_samples for i in infos) == len(ids)
        model.zero_grad()
        model.sample_mean_loss(union(ids)).backward()
        assert rel_error(got, grads(model)) < 1e-9


def test_none_mode_scale_is_one():
    infos = [odb.pop_step_info(b) for b in make_loader(gradient_accumulation_steps=3, loss_scaling="none")]
    assert len(infos) > 1 and all(i.loss_scale == 1.0 for i in infos)
    exact = [odb.pop_step_info(b) for b in make_loader(gradient_accumulation_steps=3)]
    assert any(i.loss_scale != 1.0 for i in exact)
