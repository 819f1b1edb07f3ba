"""TRL's SFTTrainer keeps the user's optimizer steps by default (global_batch_size from SFTConfig): each step
holds per_device_train_batch_size x gradient_accumulation_steps samples in odb's micro-batches, padded and
padding-free, and its gradient is the exact token mean of those samples."""

from __future__ import annotations

import pytest

import datasets  # noqa: F401  (pinned under `make test`, as trl is: a broken install fails, never skips)
import trl  # noqa: F401
import trl_workers as W

pytestmark = pytest.mark.trl

EXACT = 1e-6  # the Llama loss runs in float32 inside transformers (logits.float())


def rel_error(delta: dict, ref: dict) -> float:
    scale = max(r.abs().max().item() for r in ref.values())
    return max((delta[n] - r).abs().max().item() for n, r in ref.items()) / scale


@pytest.mark.parametrize("kind,padding_free", [("completion", False), ("assistant", True)])
def test_default_step_holds_the_users_samples_exactly(tmp_path, kind, padding_free):
    p = dict(kind=kind, n=24, ga=2, lr=1e-3, budget=120, max_steps=1, padding_free=padding_free, same_updates=True,
             args=dict(per_device_train_batch_size=5), out=str(tmp_path / "run"))
    r = W.train_ranks(0, 1, p)
    assert len(r["ids"]) == 10  # 5 x 2: the plain SFTTrainer's first step
    assert [i["micro_step"] for i in r["infos"]] == list(range(len(r["infos"])))
    ref = W.reference(W.build_trainer(p, str(tmp_path / "ref")), r["ids"], p["lr"])
    assert sum(i["local_loss_tokens"] for i in r["infos"]) == ref["tokens"]
    assert rel_error(r["delta"], ref["delta"]) < EXACT
