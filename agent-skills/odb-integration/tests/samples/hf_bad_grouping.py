# expect-framework: hf_trainer
# expect-findings: trainer-args
from transformers import Trainer, TrainingArguments
from odb.integrations.hf import enable_odb
from my_project import build_model, collator, load_sft_dataset

args = TrainingArguments(output_dir="out", dataloader_num_workers=4, train_sampling_strategy="group_by_length")
trainer = Trainer(model=build_model(), args=args, train_dataset=load_sft_dataset(), data_collator=collator)
enable_odb(trainer, token_budget=16384, global_batch_size=None)  # group_by_length's steps are the Trainer's
trainer.train()
