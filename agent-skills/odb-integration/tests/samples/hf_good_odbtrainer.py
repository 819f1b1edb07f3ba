# expect-framework: hf_trainer
# expect-findings:
"""ODBTrainer built directly; configure_trainer copies the arguments (group_by_length's steps are kept)."""
import odb.integrations.hf as odb_hf
from transformers import TrainingArguments

from my_project import build_model, collator, load_sft_dataset

args = odb_hf.configure_trainer(TrainingArguments(output_dir="out", train_sampling_strategy="group_by_length"),
                                dataloader_num_workers=8)
trainer = odb_hf.ODBTrainer(model=build_model(), args=args, train_dataset=load_sft_dataset(),
                            data_collator=collator, token_budget=8192)
trainer.train()
