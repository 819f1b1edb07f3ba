"""Fine-tune a tiny causal LM with the HuggingFace Trainer and odb (offline, CPU by default).

    python examples/hf_trainer.py
    torchrun --nproc_per_node=2 examples/hf_trainer.py     # DDP; on CPU the ranks talk over gloo

The Trainer stays a plain ``transformers.Trainer``: ``enable_odb`` switches its training
loader to token-budget batches, scales the loss exactly, counts epochs in samples and
adds odb's figures to the Trainer's logs. Tokenization runs in the loader's workers.
"""

from __future__ import annotations

import argparse
from typing import Dict, List

import torch
from transformers import DataCollatorForSeq2Seq, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from _hf_text import TokenizedTexts, sentences, train_tokenizer
from odb.integrations.hf import configure_trainer, enable_odb


class PromptAnswer(TokenizedTexts):
    """Tokenized on access: the first third of each sentence is the prompt (not trained on)."""

    def __getitem__(self, i: int) -> Dict[str, List[int]]:
        words = self.texts[i].split()
        cut = max(1, len(words) // 3)
        prompt = self.tokenizer(" ".join(words[:cut]))["input_ids"]
        answer = self.tokenizer(" ".join(words[cut:]) + " </s>")["input_ids"]
        return {"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (tokenize in parallel)")
    parser.add_argument("--out", default="out/hf_trainer")
    opts = parser.parse_args()

    texts = sentences(opts.samples + 200)
    tokenizer = train_tokenizer(texts)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    args = configure_trainer(TrainingArguments(
        opts.out, use_cpu=not torch.cuda.is_available(), num_train_epochs=opts.epochs, learning_rate=3e-3,
        lr_scheduler_type="cosine", warmup_steps=0.1, gradient_accumulation_steps=2, logging_steps=10,
        eval_strategy="epoch", save_strategy="no", report_to="none", dataloader_num_workers=opts.workers, seed=0))
    trainer = Trainer(model=model, args=args, train_dataset=PromptAnswer(texts[:opts.samples], tokenizer),
                      eval_dataset=PromptAnswer(texts[opts.samples:], tokenizer),
                      data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100))
    enable_odb(trainer, token_budget=opts.token_budget, buffer_size=256, pad_to_multiple_of=8)
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"{result.global_step} optimizer steps, train loss {result.training_loss:.3f}")
        print("last epoch on rank 0:", {k: round(v, 3) for k, v in trainer.odb_loader.odb_stats.items()
                                       if k in ("steps", "samples", "padding_ratio", "mean_batch_size")})


if __name__ == "__main__":
    main()
