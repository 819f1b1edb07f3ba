"""The rl_update section's update timing: TRL's GRPOTrainer loss on its own slices against the same trainer
with ``odb.integrations.trl.enable_odb``, on the same rollouts, on 1 or 2 gloo DDP processes.

``launch(params, world)`` starts ``python -m odb.bench.rl_update_train`` once per rank (a fresh interpreter, one
torch thread each, a gloo group on a free local port) and returns every rank's result (``summarize`` joins
them). Each rank (``run_worker``):

* builds the rollouts (``odb.bench.rl_update_rollouts``; ``params["vllm"]``: as vLLM's with TRL's correction on,
  and the trainers run TRL's loss with ``use_vllm`` and that correction): every rank draws every rank's row lengths
  from one seed (``odb.bench.rl_update_plan.draw_rollouts``) and takes its own, then the dict TRL's ``_prepare_inputs``
  hands the loss for a generation batch: ``prompt_ids``/``prompt_mask`` left-padded and
  ``completion_ids``/``completion_mask`` right-padded to the rank's longest prompt and completion, per-row
  ``advantages`` (rewards normalised within each group of ``num_generations``) and ``num_items_in_batch`` (the
  loss tokens of all ranks). No ``old_per_token_logps``: with ``num_iterations=1`` and ``steps_per_generation``
  equal to the accumulation steps TRL does not compute them either;
* builds three GRPOTrainers over one tiny Llama (random weights from a config, float32, sdpa attention),
  wrapped once in ``DistributedDataParallel``: the TRL arm with ``per_device_train_batch_size`` B (the
  largest whose worst case fits the budget) and ``gradient_accumulation_steps = steps_per_generation = N / B``;
  the odb arms with the whole generation batch as one slice (``per_device_train_batch_size = N``, 1 step) and
  ``enable_odb(trainer, token_budget, layout=...)``, padded and packed (the packed arm switches the model's
  attention to odb's per-sample ``odb_varlen``, which runs padded batches, the TRL arm's and the padded
  arm's, through transformers' ``sdpa`` as before), ``step_plan=params.get("step_plan", "auto")``: by
  default on 2 processes rows move between ranks (``"global"``: dapo's rows can move), on 1 they stay. All
  train the same N rows per rank per optimizer step (with moved rows, the same rows over all ranks: a rank
  trains some of the other's);
* times the policy update of each step: the TRL arm shuffles and cuts the generation batch as
  ``_prepare_inputs`` does (TRL's ``shuffle_sequence_dict`` and ``split_tensor_dict``) and runs, per slice, what
  ``Trainer.training_step`` runs after ``_prepare_inputs``: ``compute_loss`` then ``accelerator.backward``,
  every slice but the last under ``no_sync``; the odb arm runs the same on its one slice (odb's
  ``compute_loss`` runs TRL's loss and a backward pass per micro-batch). Gradients are zeroed between steps,
  no optimizer step (the weights stay the initial ones). Timed from a barrier to a barrier (the slowest rank
  sets it), a warm-up update per arm first (untimed: it also records the rows TRL's ``_compute_loss`` sees and
  the gradient, to check that every arm trains the same rows to the same gradient), then ``rounds``
  interleaved rounds (the arm order rotated).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from odb.bench.rl_update_rollouts import EOS, PAD, row_signatures, step_batches, with_sampling

ARMS = ("trl", "odb", "odb_packed")
ODB_ARMS = {"odb": "padded", "odb_packed": "packed"}  # odb's arms: the layout each runs


# ---- the trainers ---------------------------------------------------------------------------------------
def tokenizer(vocab: int) -> Any:
    """A word-level tokenizer of ``vocab`` tokens (pad 0, end-of-sequence 1): GRPOTrainer wants one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD, "</s>": EOS, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def build_model(cfg: Dict[str, Any], seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(attn_implementation="sdpa", pad_token_id=PAD, eos_token_id=EOS,
                                        bos_token_id=None, use_cache=False, **cfg)).float()


def build_trainer(p: Dict[str, Any], model: torch.nn.Module, per_device: int, accumulation: int, out: str) -> Any:
    """A GRPOTrainer at TRL's defaults but the batch shape (``loss_type`` dapo, ``beta`` 0, 1 iteration)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    vllm = p.get("vllm")
    correction = {} if vllm is None else {f"vllm_importance_sampling_{k}": vllm[k] for k in ("mode", "clip_min",
                                                                                            "clip_max")}
    args = GRPOConfig(output_dir=out, use_cpu=True, report_to="none", disable_tqdm=True, bf16=False,
                      save_strategy="no", logging_strategy="no", seed=0, per_device_train_batch_size=per_device,
                      gradient_accumulation_steps=accumulation, steps_per_generation=accumulation,
                      num_generations=p["generations"], max_completion_length=p["completion"][2],
                      loss_type=p["loss_type"], **correction)
    prompts = Dataset.from_dict({"prompt": ["w3 w4"] * 4 * p["rows"]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                              train_dataset=prompts, processing_class=tokenizer(p["model"]["vocab_size"]))
    if vllm is not None:  # TRL's loss as it runs after vLLM generated the rollouts (no generation runs here)
        trainer.use_vllm = True
    return trainer


def update(trainer: Any, model: torch.nn.Module, batch: Dict[str, torch.Tensor], slices: int, seed: int) -> None:
    """One optimizer step's policy update: the generation batch shuffled and cut into ``slices`` as TRL's
    ``_prepare_inputs`` does, then ``compute_loss`` and ``backward`` per slice (``Trainer.training_step`` after
    ``_prepare_inputs``), every slice but the last under ``no_sync``."""
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

    torch.manual_seed(seed)
    parts = split_tensor_dict(shuffle_sequence_dict(batch), slices) if slices > 1 else [batch]
    trainer.current_gradient_accumulation_steps = slices
    for i, part in enumerate(parts):
        sync = contextlib.nullcontext() if i == len(parts) - 1 else trainer.accelerator.no_sync(model)
        with sync:
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(model, part, num_items_in_batch=part["num_items_in_batch"])
            trainer.accelerator.backward(loss)


def _barrier(world: int) -> None:
    if world > 1:
        torch.distributed.barrier()


def _grads(model: torch.nn.Module) -> List[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _rel_gap(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    scale = max(float(x.abs().max()) for x in a) or 1.0
    return max(float((x - y).abs().max()) for x, y in zip(a, b)) / scale


def _seen(trainer: Any, rows: List[str]) -> Callable[[], None]:
    """Record the rows TRL's ``_compute_loss`` sees (an instance attribute over the class's method); returns the
    undo."""
    own = type(trainer)._compute_loss

    def seeing(model: Any, inputs: Dict[str, Any]) -> Any:
        rows.extend(row_signatures(inputs))
        return own(trainer, model, inputs)

    trainer._compute_loss = seeing
    return lambda: delattr(trainer, "_compute_loss")


def _warm_up(trainers: Dict[str, Any], model: torch.nn.Module, wrapped: torch.nn.Module,
             batches: List[Dict[str, torch.Tensor]], cuts: Dict[str, int]) -> Tuple[Dict[str, List[str]], float]:
    """Every step once per arm, untimed: the rows TRL's loss saw in each arm and the largest relative gap
    between the arms' gradients over the steps."""
    seen: Dict[str, List[str]] = {}
    grads: Dict[str, List[List[torch.Tensor]]] = {}
    for arm in trainers:
        seen[arm], grads[arm] = [], []
        undo = _seen(trainers[arm], seen[arm])
        for k, batch in enumerate(batches):
            model.zero_grad(set_to_none=True)
            update(trainers[arm], wrapped, batch, cuts[arm], seed=k)
            grads[arm].append(_grads(model))
        undo()
    return seen, max(_rel_gap(a, b) for arm in ODB_ARMS for a, b in zip(grads["trl"], grads[arm]))


def _prompt_padding(batches: List[Dict[str, torch.Tensor]]) -> int:
    """TRL's padded prompt tokens: it pads every row to the generation batch's longest prompt (odb's layouts run
    a row's prompt and completion without a gap: no prompt padding)."""
    out = 0
    for batch in batches:
        p_len, width_p = batch["prompt_mask"].sum(1).numpy(), int(batch["prompt_ids"].shape[1])
        out += len(p_len) * width_p - int(p_len.sum())
    return out


def run_worker(rank: int, world: int, p: Dict[str, Any], tmp: Optional[str] = None) -> Dict[str, Any]:
    """One rank: every arm's warm-up (rows seen, gradients), then the timed rounds. ``tmp``: the trainers'
    output_dir's parent (default: a temporary folder, removed after)."""
    if tmp is None:
        with tempfile.TemporaryDirectory(prefix="odb-rl-") as folder:
            return run_worker(rank, world, p, folder)
    from odb.integrations.trl import enable_odb

    batches = step_batches(p, rank, world)
    model = build_model(p["model"])
    if p.get("vllm"):
        batches = [with_sampling(b, model, p["vllm"], seed=p["seed"] + 1000 * k + rank) for k, b in enumerate(batches)]
    slices = p["rows"] // p["trl_rows"]
    trainers = {"trl": build_trainer(p, model, p["trl_rows"], slices, f"{tmp}/trl")}
    # odb's arms take the generation batch as one slice, unless the loss is a mean per slice (bnpo: TRL's
    # per_device_train_batch_size is part of the objective), where they keep TRL's slices and cut each.
    odb_rows, odb_slices = (p["trl_rows"], slices) if p.get("same_slices") else (p["rows"], 1)
    for arm, layout in ODB_ARMS.items():
        trainers[arm] = enable_odb(build_trainer(p, model, odb_rows, odb_slices, f"{tmp}/{arm}"),
                                   token_budget=p["budget"], layout=layout, step_plan=p.get("step_plan", "auto"))
    cuts = {arm: slices if arm == "trl" else odb_slices for arm in ARMS}
    wrapped = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    wrapped.train()
    seen, gap = _warm_up(trainers, model, wrapped, batches, cuts)
    warm = {}  # the warm-up's counts of each odb arm: micro-steps, tokens run, real tokens, micro-batches, moves
    for arm in ODB_ARMS:
        odb_rl = trainers[arm].odb_rl
        counts = odb_rl.counts
        warm[arm] = (counts.micro_steps, counts.padded_tokens, counts.real_tokens,
                     list(odb_rl.recent)[-counts.micro_steps:],  # (rows, prompt width, completion width, tokens)
                     odb_rl.step_plan, counts.moved_rows, counts.moved_bytes)
    seconds: Dict[str, List[float]] = {arm: [] for arm in ARMS}
    for r in range(p["rounds"]):
        for arm in ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]:
            _barrier(world)
            t0 = time.perf_counter()
            for k, batch in enumerate(batches):
                model.zero_grad(set_to_none=True)
                update(trainers[arm], wrapped, batch, cuts[arm], seed=k)
            _barrier(world)
            seconds[arm].append(time.perf_counter() - t0)
    widths = [int(b["prompt_ids"].shape[1] + b["completion_ids"].shape[1]) for b in batches]
    out = {"rank": rank, "seconds": seconds, "steps": len(batches),
           "real_tokens": sum(int(b["prompt_mask"].sum() + b["completion_mask"].sum()) for b in batches),
           "trl": {"padded_tokens": p["rows"] * sum(widths), "prompt_padding": _prompt_padding(batches),
                   "micro_steps": slices * len(batches), "max_micro_batch_tokens": p["trl_rows"] * max(widths)},
           "seen": {arm: sorted(rows) for arm, rows in seen.items()},  # rows moved: the same over all ranks
           "trl_saw_every_row": len(seen["trl"]) == p["rows"] * len(batches),
           "grad_rel_gap": gap, "threads": torch.get_num_threads()}
    for arm, (micro, padded, real, shapes, plan, moved_rows, moved_bytes) in warm.items():
        out[arm] = {"padded_tokens": padded, "prompt_padding": 0, "real_tokens_counted": real, "micro_steps": micro,
                    "max_micro_batch_tokens": max(s[3] for s in shapes), "micro_batches": [list(s) for s in shapes],
                    "step_plan": plan, "moved_rows": moved_rows, "moved_bytes": moved_bytes}
    return out


# ---- processes ------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(p: Dict[str, Any], world: int, timeout_s: float = 600.0) -> List[Dict[str, Any]]:
    """``run_worker`` on ``world`` processes; every rank's result (rank order). A rank that raises or a run past
    ``timeout_s`` raises RuntimeError quoting the rank's traceback or output."""
    with tempfile.TemporaryDirectory(prefix="odb-rl-launch-") as tmp_dir:
        tmp = Path(tmp_dir)
        (tmp / "params.json").write_text(json.dumps(p))
        env = dict(os.environ, OMP_NUM_THREADS=str(p.get("threads", 1)), PYTHONUNBUFFERED="1")
        port = _free_port()
        logs = [open(tmp / f"rank{r}.log", "wb") for r in range(world)]
        procs = [subprocess.Popen([sys.executable, "-m", "odb.bench.rl_update_train", str(r), str(world), str(port),
                                   str(tmp), str(timeout_s)], stdout=logs[r], stderr=subprocess.STDOUT, env=env)
                 for r in range(world)]
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline and any(q.poll() is None for q in procs):
                if any(q.poll() not in (None, 0) for q in procs):
                    break
                time.sleep(0.1)
        finally:
            for q in procs:
                if q.poll() is None:
                    q.kill()
                q.wait()
            for f in logs:
                f.close()
        for r in range(world):
            if (tmp / f"rank{r}.err").exists():
                raise RuntimeError(f"rl_update: rank {r} of {world} raised:\n{(tmp / f'rank{r}.err').read_text()}")
        missing = [r for r in range(world) if not (tmp / f"rank{r}.json").exists()]
        if missing:
            tail = (tmp / f"rank{missing[0]}.log").read_text(errors="replace")[-3000:]
            codes = [q.returncode for q in procs]
            raise RuntimeError(f"rl_update: rank(s) {missing} of {world} gave no result within {timeout_s:.0f} s "
                               f"(exit codes {codes}); rank {missing[0]}'s output ends:\n{tail}")
        return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def _child(argv: List[str]) -> None:
    rank, world, port, tmp, timeout_s = int(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3]), float(argv[4])
    try:
        p = json.loads((tmp / "params.json").read_text())
        torch.set_num_threads(int(p.get("threads", 1)))
        if world > 1:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                              LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                                 world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        result = run_worker(rank, world, p, str(tmp / f"rank{rank}"))
        if world > 1:
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        (tmp / f"rank{rank}.tmp").write_text(json.dumps(result))
        os.replace(tmp / f"rank{rank}.tmp", tmp / f"rank{rank}.json")
    except BaseException:  # noqa: BLE001 - reported to the parent, which names the rank
        (tmp / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1)


def summarize(ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Every arm's figures over all ranks: padding share, micro-steps per step, update seconds (median, min-max
    over rounds: a round's time is the slowest rank's, the barriers make them equal)."""
    steps = ranks[0]["steps"]
    real = sum(r["real_tokens"] for r in ranks)
    seen = {arm: sorted(row for r in ranks for row in r["seen"][arm]) for arm in ARMS}  # every rank's rows together
    same = all(seen[arm] == seen["trl"] for arm in ODB_ARMS) and all(r["trl_saw_every_row"] for r in ranks)
    out: Dict[str, Any] = {"arms": {}, "same_rows": same,
                           "grad_rel_gap": max(r["grad_rel_gap"] for r in ranks), "real_tokens": real}
    for arm in ARMS:
        secs = [max(r["seconds"][arm][k] for r in ranks) / steps for k in range(len(ranks[0]["seconds"][arm]))]
        padded = sum(r[arm]["padded_tokens"] for r in ranks)
        out["arms"][arm] = {"padding_share": 1.0 - real / padded, "padded_tokens": padded,
                            "prompt_padding_share": sum(r[arm]["prompt_padding"] for r in ranks) / padded,
                            "micro_steps_per_step": ranks[0][arm]["micro_steps"] / steps,
                            "max_micro_batch_tokens": max(r[arm]["max_micro_batch_tokens"] for r in ranks),
                            "update_s": {"median": float(np.median(secs)), "min": min(secs), "max": max(secs)},
                            "rounds_s": secs}
    for arm in ODB_ARMS:  # rows moved: a rank counts the rows it trained, so the sums over ranks must agree
        out["arms"][arm].update(step_plan=ranks[0][arm]["step_plan"],
                                moved_rows_per_step=sum(r[arm]["moved_rows"] for r in ranks) / steps,
                                moved_bytes_per_step=sum(r[arm]["moved_bytes"] for r in ranks) / steps)
        if sum(r[arm]["real_tokens_counted"] for r in ranks) != real:
            out["odb_real_tokens_mismatch"] = [(arm, r[arm]["real_tokens_counted"], r["real_tokens"]) for r in ranks]
    return out


if __name__ == "__main__":
    _child(sys.argv[1:])
