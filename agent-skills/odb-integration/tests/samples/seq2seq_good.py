# expect-framework: seq2seq_trainer
# expect-findings:
"""Encoder-decoder: one budget per side (source, target) with odb.seq2seq_lengths."""
import odb
from odb.integrations.hf import enable_odb
from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments
from my_project import build_model, load_pairs, tokenizer

args = Seq2SeqTrainingArguments(output_dir="out", dataloader_num_workers=4, predict_with_generate=True)
trainer = Seq2SeqTrainer(model=build_model(), args=args, train_dataset=load_pairs("train"),
                         eval_dataset=load_pairs("dev"), data_collator=DataCollatorForSeq2Seq(tokenizer))
enable_odb(trainer, token_budget=(4096, 4096), length_fn=odb.seq2seq_lengths)
trainer.train()
trainer.evaluate()
