# expect-framework: llamafactory
# expect-findings:
"""A LLaMA-Factory SFT workflow of your own: CustomSeq2SeqTrainer switched to odb before train()."""
from llamafactory.data import SFTDataCollatorWith4DAttentionMask, get_dataset, get_template_and_fix_tokenizer
from llamafactory.extras.constants import IGNORE_INDEX
from llamafactory.hparams import get_train_args
from llamafactory.model import load_model, load_tokenizer
from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer

from odb.integrations.llamafactory import enable_odb


def main():
    model_args, data_args, training_args, finetuning_args, _ = get_train_args()
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    dataset_module = get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)
    model = load_model(tokenizer_module["tokenizer"], model_args, finetuning_args, training_args.do_train)
    collator = SFTDataCollatorWith4DAttentionMask(template=template, model=model, pad_to_multiple_of=8,
                                                  label_pad_token_id=IGNORE_INDEX, **tokenizer_module)
    trainer = CustomSeq2SeqTrainer(model=model, args=training_args, finetuning_args=finetuning_args,
                                   data_collator=collator, **dataset_module, **tokenizer_module)
    enable_odb(trainer=trainer, token_budget=16384, buffer_size=2048)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)


if __name__ == "__main__":
    main()
