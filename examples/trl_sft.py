"""Supervised fine-tuning with TRL's SFTTrainer and odb (offline, CPU by default).

    python examples/trl_sft.py
    python examples/trl_sft.py --padding-free                   # one padding-free row per batch
    python examples/trl_sft.py --padding-free --attn sdpa       # the same rows through a dense mask (slower)
    torchrun --nproc_per_node=2 examples/trl_sft.py            # DDP; on CPU the ranks talk over gloo

TRL does its own data preparation (tokenization, EOS, the completion mask of
prompt-completion data, and from TRL 1.9 the labels and the truncation to max_length):
only the completion is trained on. ``enable_odb`` switches the trainer's training loader
to token-budget batches, counts the supervised tokens exactly as TRL's labels hold them,
scales the loss exactly, and counts epochs and the learning-rate schedule in samples.
With ``--padding-free`` the model attends per sample of each row with odb's
``odb_varlen`` (use ``flash_attention_2`` on CUDA where flash-attn is installed).
"""

from __future__ import annotations

import argparse

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM
from trl import SFTConfig, SFTTrainer

import odb
from _hf_text import sentences, train_tokenizer
from odb.integrations.hf import configure_trainer
from odb.integrations.trl import enable_odb


def prompt_completion(texts: list) -> Dataset:
    """The first third of each sentence is the prompt, the rest the completion (TRL trains on it only)."""
    rows = [(t.split()[:max(1, len(t.split()) // 3)], t.split()[max(1, len(t.split()) // 3):]) for t in texts]
    return Dataset.from_dict({"prompt": [" ".join(p) for p, _ in rows],
                              "completion": [" " + " ".join(c or ["the"]) for _, c in rows]})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--padding-free", action="store_true", help="TRL's padding_free=True (odb's packed rows)")
    parser.add_argument("--attn", default=None, help="attn_implementation (default: odb_varlen with --padding-free, "
                        "else sdpa)")
    parser.add_argument("--out", default="out/trl_sft")
    opts = parser.parse_args()

    texts = sentences(opts.samples)
    tokenizer = train_tokenizer(texts)
    # Packed rows cost what their samples cost only with an attention that works per sample.
    attn = opts.attn or (odb.register_varlen_attention() if opts.padding_free else "sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                         attn_implementation=attn))
    args = configure_trainer(SFTConfig(
        opts.out, use_cpu=not torch.cuda.is_available(), num_train_epochs=opts.epochs, learning_rate=3e-3,
        lr_scheduler_type="cosine", warmup_steps=0.1, gradient_accumulation_steps=2, logging_steps=10,
        save_strategy="no", report_to="none", seed=0, padding_free=opts.padding_free,
        # TRL (>= 1.0) truncates to max_length only when rows are padded: padding_free=True needs max_length=None,
        # and then enable_odb refuses any sample longer than token_budget before training starts.
        max_length=None if opts.padding_free else 256))
    trainer = SFTTrainer(model=model, args=args, train_dataset=prompt_completion(texts), processing_class=tokenizer)
    enable_odb(trainer, token_budget=opts.token_budget, buffer_size=256)
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"{result.global_step} optimizer steps, train loss {result.training_loss:.3f}")
        stats = trainer.odb_loader.odb_stats
        print(f"layout {trainer.odb_config.layout!r}; last epoch on rank 0:",
              {k: round(stats[k], 3) for k in ("steps", "samples", "mean_batch_size", "padding_ratio", "loss_tokens")})


if __name__ == "__main__":
    main()
