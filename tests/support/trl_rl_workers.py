"""TRL GRPOTrainer / RLOOTrainer runs with and without odb, shared by tests/integrations/test_trl_grpo.py and its
2-process runs ("trl_rl_workers:pair_ranks").

Everything is offline: the tokenizer of tests/support/trl_workers.py, a float64 tiny Llama from a config
(sdpa attention: eager attention in float64 turns the fully masked rows of left padding into NaN), prompts
of 1 to 10 words and a reward of the completion's words. Generation is TRL's own, sampled: the two arms
(TRL alone, then TRL with odb) are built and trained in the same process from the same seed, so they sample
the same rollouts (odb adds no random draw), and the gradient of every optimizer step is recorded before
the optimizer uses it. An end-of-sequence bias at generation (``sequence_bias``) gives completions of
varied lengths, so odb's trimming has padding to cut.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List

import torch

from odb.integrations.trl_rl import RolloutCounts

import trl_workers as W

EOS = 1  # "</s>" of trl_workers.tokenizer()


def llama(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa",
                      eos_token_id=EOS, pad_token_id=0, bos_token_id=None)
    return LlamaForCausalLM(cfg).to(torch.float64)


def prompts(n: int, seed: int = 3) -> Any:
    from datasets import Dataset

    texts = W.sentences(n, seed=seed, low=10, high=14)
    return Dataset.from_dict({"prompt": [" ".join(t.split()[:1 + (7 * i) % 10]) for i, t in enumerate(texts)]})


def reward(completions: List[str], **_: Any) -> List[float]:
    return [float(len(set(c.split()))) - 0.3 * len(c.split()) for c in completions]


class GradRecorder:
    """A TrainerCallback recording every optimizer step's gradient (before the optimizer uses it)."""

    def __new__(cls) -> Any:
        from transformers import TrainerCallback

        class _Recorder(TrainerCallback):
            def __init__(self) -> None:
                self.grads: List[List[torch.Tensor]] = []

            def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
                self.grads.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                                   for p in model.parameters()])

        return _Recorder()


def build(p: Dict[str, Any], out: str, recorder: Any) -> Any:
    """A GRPOTrainer (``p['trainer'] == 'grpo'``) or RLOOTrainer over ``prompts``, TRL's defaults but ``p``."""
    import trl

    common = dict(output_dir=out, use_cpu=True, report_to="none", disable_tqdm=True, bf16=False, optim="sgd",
                  learning_rate=p.get("lr", 0.5), weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant",
                  max_steps=p.get("max_steps", 2), save_strategy="no", logging_strategy="no", seed=11,
                  per_device_train_batch_size=p.get("per_device", 4), gradient_accumulation_steps=p.get("ga", 2),
                  num_generations=p.get("num_generations", 4), max_completion_length=p.get("max_completion", 12),
                  beta=p.get("beta", 0.0), num_iterations=p.get("num_iterations", 1),
                  generation_kwargs={"sequence_bias": [[[EOS], p.get("eos_bias", 2.5)]]})
    model: Any = llama(0)
    if p.get("beta"):  # TRL loads the reference model from the policy's path: a saved copy of the same weights
        from safetensors.torch import save_file

        path = f"{out}-base"  # written by hand: save_pretrained writes on rank 0 only under torch.distributed
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{path}/model.safetensors")
        model = path
        common["model_init_kwargs"] = {"dtype": "auto", "attn_implementation": "sdpa"}  # float64, as saved
    if p.get("steps_per_generation"):
        common["steps_per_generation"] = p["steps_per_generation"]
    common.update(p.get("args", {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if p.get("trainer", "grpo") == "rloo":
            return trl.RLOOTrainer(model=model, reward_funcs=reward, args=trl.RLOOConfig(**common),
                                   train_dataset=prompts(p.get("prompts", 16)), processing_class=W.tokenizer(),
                                   callbacks=[recorder])
        args = trl.GRPOConfig(loss_type=p.get("loss_type", "dapo"), **common)
        return trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=prompts(p.get("prompts", 16)),
                               processing_class=W.tokenizer(), callbacks=[recorder])


def train_arm(p: Dict[str, Any], out: str, budget: Any) -> Dict[str, Any]:
    """Train one arm (``budget`` None: TRL alone); its gradients, losses and odb's micro-batches."""
    from odb.integrations import trl as odb_trl

    recorder = GradRecorder()
    trainer = build(p, out, recorder)
    if budget is not None:
        odb_trl.enable_odb(trainer, token_budget=budget, layout=p.get("layout", "padded"),
                           step_plan=p.get("step_plan", "auto"))
    losses: List[float] = []
    slices: List[int] = []  # padded tokens of every training slice TRL hands the loss (rows x its widths)
    step, loss_of = trainer.training_step, trainer.compute_loss

    def seeing_loss(model: Any, inputs: Dict[str, Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        if trainer.model.training:
            slices.append(int(inputs["prompt_ids"].shape[0]) * (int(inputs["prompt_ids"].shape[1])
                                                                  + int(inputs["completion_ids"].shape[1])))
        return loss_of(model, inputs, *args, **kwargs)

    def recording_step(*args: Any, **kwargs: Any) -> torch.Tensor:  # the loss the Trainer logs, per training step
        loss = step(*args, **kwargs)
        losses.append(float(loss))
        return loss

    trainer.training_step = recording_step
    trainer.compute_loss = seeing_loss
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    odb = getattr(trainer, "odb_rl", None)
    counts = odb.counts if odb is not None else RolloutCounts()
    return {"grads": recorder.grads, "losses": losses, "slice_tokens": sum(slices),
            "micro_batches": list(odb.recent) if odb is not None else [],
            "micro_steps": counts.micro_steps, "slices": counts.slices, "padded": counts.padded_tokens,
            "budget": budget, "real": counts.real_tokens,
            "plans": [plan_record(p) for p in odb.plans] if odb is not None else [],
            "step_plan": odb.step_plan if odb is not None else None,
            "moves": list(odb.moves) if odb is not None else [],
            "moved_rows": counts.moved_rows, "logs": list(trainer.state.log_history)}


def plan_record(plan: Any) -> Any:
    """A plan as plain lists: a rank-local plan's rows per micro-step, a global plan's flat rows per rank and
    micro-step."""
    if hasattr(plan, "groups"):
        return [[g.tolist() for g in rank] for rank in plan.groups]
    return list(plan.sizes)


def pair_ranks(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """TRL alone, then TRL with odb (``p['budget']``), on this rank; both arms' records."""
    out = p.get("out", "/tmp/odb-trl-rl")
    return {"ref": train_arm(p, f"{out}/ref{rank}", None), "odb": train_arm(p, f"{out}/odb{rank}", p["budget"])}


def suite_ranks(rank: int, world: int, p: Dict[str, Any]) -> List[Dict[str, Any]]:
    """``pair_ranks`` for each of ``p['runs']`` (one process start for several settings)."""
    if world > 1:
        W.H._join_torch_distributed(rank, world)  # accelerate reads the launcher's variables
    return [pair_ranks(rank, world, dict(run, out=p.get("out", "/tmp/odb-trl-rl"))) for run in p["runs"]]
