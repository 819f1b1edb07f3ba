# expect-framework: hf_trainer
# expect-findings:
"""ODBTrainer built directly; configure_trainer copies the arguments with batch size 1 and no grouping."""
import odb.integrations.hf as odb_hf
from transformers import TrainingArguments

from my_project import build_model, collator, load_sft_dataset

args = odb_hf.configure_trainer(TrainingArguments(output_dir="out", train_sampling_strategy="group_by_length"),
                                dataloader_num_workers=8)
trainer = odb_hf.ODBTrainer(model=build_model(), args=args, train_dataset=load_sft_dataset(),
                            data_collator=collator, token_budget=8192)
trainer.train()
