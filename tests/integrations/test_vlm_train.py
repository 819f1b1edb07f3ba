"""Vision-language models trained through the HF Trainer + enable_odb: exact, within the budget, never a hang.

Tiny Qwen2-VL and LLaVA (odb.bench.vlm_data: real transformers classes from configs, real
processors, float64), the padded collator a user writes, image-patch cap. Checked, in 1 process
and in 2 gloo processes, with gradient checkpointing on and off: every sample trained once,
the same number of optimizer steps on every rank, no micro-batch over the token budget or the
patch cap, and every optimizer step's gradient equal to a one-process reference over the
step's samples, each alone. Gradients agree to ~1e-7, not 1e-15: both models compute their
rotary angles in float32, whose cos/sin differ by an ulp with the tensor's shape (a padded
batch against a sample alone); a wrong loss scale or a lost image is off by far more.

Image-less ranks: under DDP with find_unused_parameters=False (the Trainer's choice with
gradient checkpointing) and under FSDP2, a rank whose micro-batch holds no image skipped the
vision tower and the ranks hung (this test, without the dummy: both ranks silent until the
240 s deadline). odb now collates a dummy image into such micro-batches
(odb.integrations.vlm): the split runs give rank 0 every image and rank 1 none, with ghost
steps on rank 1, and must train exactly. Worker functions: tests/support/vlm_workers.py.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Dict, List, Optional

import pytest
import torch

import vlm_workers as VW
from dist_harness import run_ranks
from odb.bench import vlm_data as V

pytestmark = pytest.mark.dist
HAS_TRL = importlib.util.find_spec("trl") is not None  # make test-min has no TRL
# fully_shard on CPU ranks fails inside torch 2.6 itself (tests/integrations/test_fsdp.py): FSDP2 runs from 2.13
FSDP2_ON_CPU = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13)
ROPE_FLOAT32 = 1e-5  # relative; see the module docstring (measured: at most 4e-7)
SAME_PLAN = 1e-9  # the same batches with and without gradient checkpointing (which recomputes the same forward)
QWEN = dict(model="qwen2_vl", n=16, budget=256, patch_cap=400)
LLAVA = dict(model="llava", n=16, budget=160, patch_cap=48)


def check_run(p: Dict[str, Any], ranks: List[Dict[str, Any]], same_as: Optional[List[Dict[str, Any]]] = None
              ) -> Dict[str, Any]:
    """The checks every run passes; returns counts the callers check further. ``same_as``: a run of the same
    plan already checked against the reference (its steps and gradients must be this run's: saves a reference)."""
    counts = {len(r["steps"]) for r in ranks}
    assert len(counts) == 1, f"ranks took different numbers of optimizer steps: {counts}"
    steps = [[i for r in ranks for i in r["steps"][s]["ids"]] for s in range(counts.pop())]
    n = p["n"] if p.get("trl") else len(VW.dataset(p))
    assert sorted(i for s in steps for i in s) == list(range(n)), "every sample exactly once"
    dummies = 0
    for r in ranks:
        for b in r["seen"]:
            dummies += b["dummy"]
            if not b["dummy"]:
                assert b["rows"] * b["width"] <= p["budget"], f"batch over token_budget={p['budget']}: {b}"
                assert b["patches"] <= p["patch_cap"], f"batch over max_image_patches={p['patch_cap']}: {b}"
    if same_as is not None:
        assert [[i for r in same_as for i in r["steps"][s]["ids"]] for s in range(len(steps))] == steps
        ref = [s["grads"] for s in same_as[0]["steps"]]
        tolerance = SAME_PLAN
    else:
        ref = VW.trl_reference(p, steps) if p.get("trl") else VW.reference_grads(p, steps)
        tolerance = ROPE_FLOAT32
    errors = [VW.max_rel_error(s["grads"], g) for s, g in zip(ranks[0]["steps"], ref)]
    assert max(errors) < tolerance, f"step gradients off the token-mean reference: {errors}"
    return {"dummies": dummies, "ghosts": [sum(s["ghosts"] for s in r["steps"]) for r in ranks],
            "image_less": [sum(b["patches"] == 0 or b["dummy"] for b in r["seen"]) for r in ranks]}


@pytest.mark.parametrize("p", [dict(QWEN, gc=False, ga=2), dict(LLAVA, gc=True, ga=1)], ids=["qwen2_vl", "llava-gc"])
def test_one_process_trains_exactly(tmp_path, p):
    run = VW.train(0, 1, dict(p, out=str(tmp_path)))
    got = check_run(p, [run])
    assert got["dummies"] == 0, "one process needs no dummy image"


def test_trl_sft_trainer_trains_a_vlm_exactly(tmp_path):
    """TRL's vision path (a processor, image samples: DataCollatorForVisionLanguageModeling) through enable_odb:
    each sample processed alone by TRL's collator, padded by odb into the batch TRL's collator builds."""
    pytest.importorskip("trl")
    import datasets
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from odb.integrations.trl.vision import vision_samples

    p = dict(QWEN, trl=True, ga=2)
    run = VW.trl_train(0, 1, dict(p, out=str(tmp_path)))
    assert run["collator"] == "DataCollatorForVisionLanguageModeling"
    check_run(p, [run])
    raw = datasets.Dataset.from_list(VW.raw_chats(6))
    trl_collate = DataCollatorForVisionLanguageModeling(V.build_processor("qwen2_vl"))
    samples, pad, swapped = vision_samples(raw, trl_collate)
    assert swapped and sum(samples[i]["image_patches"] > 0 for i in range(6)) >= 2
    ours, theirs = pad([samples[i] for i in range(6)]), trl_collate([dict(s) for s in raw])
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


def test_two_processes_train_exactly_and_never_hang(tmp_path):
    # DDP: find_unused_parameters=False with gradient checkpointing (the Trainer's choice), True without it; each
    # model's run without checkpointing has the same plan and must give the same gradients
    runs = [dict(QWEN, gc=True, ga=2), dict(QWEN, gc=False, ga=2),
            dict(LLAVA, gc=True, ga=2, freeze_vision=True), dict(LLAVA, gc=False, ga=2, freeze_vision=True),
            # rank 0 every image, rank 1 none; one sample per micro-batch: rank 1 runs out first (a ghost step) and
            # its micro-batches have no padding slot (the dummy's token gets a column of its own)
            dict(QWEN, gc=True, ga=1, split=True, odb=dict(max_batch_size=1)),
            dict(QWEN, gc=False, ga=1, split=True, odb=dict(max_batch_size=1))]  # find_unused: DDP copes, no dummy
    if FSDP2_ON_CPU:
        path = tmp_path / "qwen"
        V.build_model("qwen2_vl", seed=0, dtype=torch.float64).save_pretrained(path)
        runs.append(dict(QWEN, gc=True, ga=2, split=True, fsdp=True, path=str(path)))  # FSDP2 at load time
    if HAS_TRL:
        runs.append(dict(QWEN, trl=True, ga=1, gc=True))  # TRL: checkpointing, find_unused_parameters=True
    ranks = run_ranks("vlm_workers:suite", 2, {"runs": runs, "out": str(tmp_path)}, tmp_path / "h", deadline_s=240)
    for k, p in enumerate(runs):
        same = [r[k - 1] for r in ranks] if k in (1, 3, 5) else None
        got = check_run(p, [r[k] for r in ranks], same_as=same)
        unused = ranks[0][k].get("find_unused")
        if not p.get("fsdp") and not p.get("trl"):
            assert unused is (not p["gc"]), f"run {k}: the Trainer's find_unused_parameters is {unused}"
        if p.get("trl") or not p["gc"]:  # DDP with find_unused_parameters=True: no dummy needed, none added
            assert got["dummies"] == 0, f"run {k}: {got}"
        if p.get("split"):  # every micro-batch of rank 1 lacks images of its own, none of rank 0's
            assert got["image_less"][0] == 0 < got["image_less"][1], f"run {k}: {got}"
            assert got["ghosts"][1] > 0 or "odb" not in p, f"run {k}: expected a ghost step on rank 1: {got}"
            if p["gc"]:
                assert got["dummies"] == got["image_less"][1], f"run {k}: expected a dummy in each: {got}"
