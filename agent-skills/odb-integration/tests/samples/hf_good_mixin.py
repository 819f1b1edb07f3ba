# expect-framework: hf_trainer
# expect-findings:
"""A custom Trainer subclass gets odb through ODBTrainerMixin, placed first."""
from transformers import Trainer, TrainingArguments

from odb.integrations.hf import ODBTrainerMixin
from my_project import build_model, collator, load_sft_dataset


class MyTrainer(ODBTrainerMixin, Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


args = TrainingArguments(output_dir="out", dataloader_num_workers=4, gradient_accumulation_steps=2)
trainer = MyTrainer(model=build_model(), args=args, train_dataset=load_sft_dataset(), data_collator=collator,
                    token_budget=16384, max_batch_size=64)
trainer.train()
