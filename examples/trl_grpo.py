"""GRPO (or RLOO) with TRL and odb cutting the policy update by tokens (offline, CPU by default).

    python examples/trl_grpo.py
    python examples/trl_grpo.py --loss-type grpo --beta 0.05     # another loss, with a KL to a reference model
    python examples/trl_grpo.py --rloo                           # TRL's RLOOTrainer
    python examples/trl_grpo.py --packed                         # packed micro-batches: no padding at all
    torchrun --nproc_per_node=2 examples/trl_grpo.py            # DDP; on CPU the ranks talk over gloo

TRL samples prompts, generates completions, scores them and computes advantages as it
always does. Each training step TRL hands its slice of the generation batch to the loss;
``enable_odb`` (odb.integrations.trl.rl) cuts that slice into micro-batches of at most
``--token-budget`` tokens, runs each row without the gap TRL leaves between a short prompt
and its completion (rows right-padded to the micro-batch's longest, or packed into one row
with ``--packed``), and runs TRL's own loss and a backward pass on each: the gradient is
TRL's, on fewer padded tokens. The reward here is a toy one (distinct words, minus a little per word) so the
example runs offline in seconds; the tokenizer is trained on generated sentences.
"""

from __future__ import annotations

import argparse

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from _hf_text import sentences, train_tokenizer
from odb.integrations.trl import enable_odb


def reward(completions: list, **_: object) -> list:
    """More distinct words is better; every word costs a little (so completions end)."""
    return [float(len(set(c.split()))) - 0.3 * len(c.split()) for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--token-budget", type=int, default=96)
    parser.add_argument("--loss-type", default="dapo", help="GRPO's loss_type (TRL's default: dapo)")
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (a reference model when > 0)")
    parser.add_argument("--rloo", action="store_true", help="TRL's RLOOTrainer instead of GRPOTrainer")
    parser.add_argument("--packed", action="store_true", help="packed micro-batches (layout='packed')")
    parser.add_argument("--out", default="out/trl_grpo")
    opts = parser.parse_args()

    texts = sentences(opts.prompts + 200, seed=1)
    tokenizer = train_tokenizer(texts)
    words = [t.split() for t in texts[:opts.prompts]]
    prompts = Dataset.from_dict({"prompt": [" ".join(w[:1 + i % 12]) for i, w in enumerate(words)]})
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                         attn_implementation="sdpa"))
    common = dict(output_dir=opts.out, use_cpu=not torch.cuda.is_available(), max_steps=opts.steps,
                  per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
                  max_completion_length=24, beta=opts.beta, learning_rate=1e-3, logging_steps=1,
                  save_strategy="no", report_to="none", seed=0, bf16=False,
                  # completions that end at different lengths: something for odb's trimming to cut
                  generation_kwargs={"sequence_bias": [[[tokenizer.eos_token_id], 2.0]]})
    if opts.rloo:
        trainer = RLOOTrainer(model=model, reward_funcs=reward, args=RLOOConfig(**common), train_dataset=prompts,
                              processing_class=tokenizer)
    else:
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(loss_type=opts.loss_type, **common),
                              train_dataset=prompts, processing_class=tokenizer)
    enable_odb(trainer, token_budget=opts.token_budget, layout="packed" if opts.packed else "padded")
    result = trainer.train()
    if trainer.is_world_process_zero():
        odb = trainer.odb_rl
        print(f"{result.global_step} optimizer steps, train loss {result.training_loss:.4f}")
        counts = odb.counts
        print(f"{counts.slices} training slices cut into {counts.micro_steps} micro-batches on rank 0; padded "
              f"tokens {counts.padded_tokens} (real {counts.real_tokens}), budget {odb.token_budget}, layout "
              f"{odb.forward.layout!r}")


if __name__ == "__main__":
    main()
