# expect-framework: hf_trainer
# expect-findings:
"""HF Trainer switched to odb in place with enable_odb (torchrun or accelerate launch for several GPUs)."""
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

from odb.integrations.hf import enable_odb
from my_project import load_sft_dataset


def main():
    tokenizer = AutoTokenizer.from_pretrained("my-org/my-model")
    model = AutoModelForCausalLM.from_pretrained("my-org/my-model")
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=1, gradient_accumulation_steps=4,
                             dataloader_num_workers=4, num_train_epochs=2, learning_rate=2e-5, bf16=True,
                             logging_steps=10)
    trainer = Trainer(model=model, args=args, train_dataset=load_sft_dataset(tokenizer),
                      data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True))
    enable_odb(trainer, token_budget=16384, buffer_size=2048, pad_to_multiple_of=8)
    trainer.train()


if __name__ == "__main__":
    main()
