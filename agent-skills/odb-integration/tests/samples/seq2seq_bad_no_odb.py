# expect-framework: seq2seq_trainer
# expect-findings: odb-missing
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments
from my_project import build_model, collator, load_pairs

args = Seq2SeqTrainingArguments(output_dir="out", per_device_train_batch_size=32, dataloader_num_workers=4)
Seq2SeqTrainer(model=build_model(), args=args, train_dataset=load_pairs("train"), data_collator=collator).train()
