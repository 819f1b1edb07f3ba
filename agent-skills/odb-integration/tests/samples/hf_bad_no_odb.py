# expect-framework: hf_trainer
# expect-findings: odb-missing
"""odb imported and a loader built by hand, but the Trainer builds and uses its own loader."""
import odb
from transformers import Trainer, TrainingArguments
from my_project import build_model, collator, load_sft_dataset

dataset = load_sft_dataset()
loader = odb.ODBDataLoader(dataset, token_budget=16384, num_workers=4, collate_fn=collator)
args = TrainingArguments(output_dir="out", dataloader_num_workers=4)
trainer = Trainer(model=build_model(), args=args, train_dataset=dataset, data_collator=collator)
trainer.train()
