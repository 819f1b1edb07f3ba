# expect-framework: hf_trainer
# expect-findings: num-workers
from transformers import Trainer, TrainingArguments
from odb.integrations.hf import enable_odb
from my_project import build_model, collator, load_sft_dataset

args = TrainingArguments(output_dir="out", num_train_epochs=1)
trainer = Trainer(model=build_model(), args=args, train_dataset=load_sft_dataset(), data_collator=collator)
enable_odb(trainer, 16384)
trainer.train()
