"""Train a tiny T5-like translator with Seq2SeqTrainer and odb (offline, CPU by default).

    python examples/seq2seq_trainer.py
    torchrun --nproc_per_node=2 examples/seq2seq_trainer.py

Source and target lengths are both counted (``length_fn=odb.seq2seq_lengths``): a batch
of B pairs costs B x (longest source) against the source budget and B x (longest
target) against the target budget.
"""

from __future__ import annotations

import argparse
from typing import Dict, List

import torch
from transformers import (DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments, T5Config,
                          T5ForConditionalGeneration)

import odb
from _hf_text import TokenizedTexts, sentences, train_tokenizer
from odb.integrations.hf import configure_trainer, enable_odb


def translate(text: str) -> str:
    """The toy target language: words reversed, each with a suffix."""
    return " ".join(w + "en" for w in reversed(text.split()))


class Pairs(TokenizedTexts):
    def __getitem__(self, i: int) -> Dict[str, List[int]]:
        source = self.tokenizer(self.texts[i] + " </s>")["input_ids"]
        target = self.tokenizer(translate(self.texts[i]) + " </s>")["input_ids"]
        return {"input_ids": source, "attention_mask": [1] * len(source), "labels": target}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--source-budget", type=int, default=768)
    parser.add_argument("--target-budget", type=int, default=768)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (tokenize in parallel)")
    parser.add_argument("--out", default="out/seq2seq_trainer")
    opts = parser.parse_args()

    texts = sentences(opts.samples + 200, high=40)
    tokenizer = train_tokenizer(texts + [translate(t) for t in texts])
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(
        vocab_size=len(tokenizer), d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id))
    args = configure_trainer(Seq2SeqTrainingArguments(
        opts.out, use_cpu=not torch.cuda.is_available(), num_train_epochs=opts.epochs, learning_rate=3e-3,
        warmup_steps=0.1, logging_steps=10, eval_strategy="epoch", save_strategy="no", report_to="none",
        dataloader_num_workers=opts.workers, seed=0))
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=Pairs(texts[:opts.samples], tokenizer),
                             eval_dataset=Pairs(texts[opts.samples:], tokenizer),
                             data_collator=DataCollatorForSeq2Seq(tokenizer, model=model))
    enable_odb(trainer, token_budget=(opts.source_budget, opts.target_budget), length_fn=odb.seq2seq_lengths,
               buffer_size=256)
    result = trainer.train()
    if trainer.is_world_process_zero():
        history = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
        print(f"{result.global_step} optimizer steps, train loss {result.training_loss:.3f}, "
              f"eval loss by epoch {[round(v, 3) for v in history]}")


if __name__ == "__main__":
    main()
