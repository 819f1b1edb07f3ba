# expect-framework: hf_trainer
# expect-findings: mixin-order
from transformers import Trainer, TrainingArguments
from odb.integrations.hf import ODBTrainerMixin
from my_project import build_model, collator, load_sft_dataset


class MyTrainer(Trainer, ODBTrainerMixin):
    pass


args = TrainingArguments(output_dir="out", dataloader_num_workers=4)
MyTrainer(model=build_model(), args=args, train_dataset=load_sft_dataset(), data_collator=collator,
          token_budget=16384).train()
