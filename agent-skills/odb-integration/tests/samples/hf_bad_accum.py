# expect-framework: hf_trainer
# expect-findings: grad-accum
from transformers import Trainer, TrainingArguments
from odb.integrations.hf import enable_odb
from my_project import build_model, collator, load_sft_dataset

args = TrainingArguments(output_dir="out", dataloader_num_workers=4, gradient_accumulation_steps=8)
trainer = Trainer(model=build_model(), args=args, train_dataset=load_sft_dataset(), data_collator=collator)
enable_odb(trainer, token_budget=16384, gradient_accumulation_steps=4)
trainer.train()
