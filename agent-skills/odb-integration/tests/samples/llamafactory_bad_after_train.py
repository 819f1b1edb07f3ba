# expect-framework: llamafactory
# expect-findings: integration-order
from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer
from odb.integrations.llamafactory import enable_odb
from my_project import build_parts

model, training_args, finetuning_args, collator, dataset_module = build_parts()
trainer = CustomSeq2SeqTrainer(model=model, args=training_args, finetuning_args=finetuning_args,
                               data_collator=collator, **dataset_module)
trainer.train()
enable_odb(trainer=trainer, token_budget=16384)
