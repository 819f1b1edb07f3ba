"""Tiny HF models, datasets and Trainer runs shared by tests/integrations/test_hf.py and its multi-rank runs.

``train_ranks`` runs on every rank of dist_harness.run_ranks ("hf_workers:train_ranks");
the same function runs in the test process for one rank. Models are float64 and built
from configs with a fixed seed (random init, no hub), so a reference step computed in
one process from the same seed is comparable to a few ulps.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

VOCAB = 48
IGNORE = -100


# ---- data ----------------------------------------------------------------------------------


def lengths_for(n: int, seed: int = 0, low: int = 3, high: int = 28) -> List[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (n,), generator=g).tolist()


def causal_sample(i: int, n: int, unsupervised: bool = False) -> Dict[str, torch.Tensor]:
    """input_ids of length n; labels with every third token from the second unsupervised."""
    ids = (torch.arange(n) * 7 + i) % (VOCAB - 1) + 1
    labels = ids.clone()
    labels[1::3] = IGNORE
    if unsupervised:
        labels[:] = IGNORE
    return {"input_ids": ids, "labels": labels}


def causal_dataset(n: int, seed: int = 0, unsupervised: Sequence[int] = ()) -> List[Dict[str, torch.Tensor]]:
    return [causal_sample(i, k, i in unsupervised) for i, k in enumerate(lengths_for(n, seed))]


def seq2seq_dataset(n: int, seed: int = 0, unsupervised: Sequence[int] = ()) -> List[Dict[str, torch.Tensor]]:
    out = []
    for i, (src, tgt) in enumerate(zip(lengths_for(n, seed), lengths_for(n, seed + 1, 2, 16))):
        labels = (torch.arange(tgt) * 5 + i) % (VOCAB - 1) + 1
        if i in unsupervised:
            labels[:] = IGNORE
        out.append({"input_ids": (torch.arange(src) * 3 + i) % (VOCAB - 1) + 1, "labels": labels})
    return out


def pad_collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Right-pads input_ids (0, with attention_mask) and labels (-100) separately."""
    out: Dict[str, torch.Tensor] = {}
    for key, fill in (("input_ids", 0), ("labels", IGNORE)):
        width = max(len(s[key]) for s in samples)
        out[key] = torch.full((len(samples), width), fill, dtype=torch.long)
        for row, s in enumerate(samples):
            out[key][row, :len(s[key])] = s[key]
    out["attention_mask"] = (torch.arange(out["input_ids"].shape[1])[None, :]
                             < torch.tensor([len(s["input_ids"]) for s in samples])[:, None]).long()
    return out


# ---- models --------------------------------------------------------------------------------


def llama(seed: int = 0, dropout: float = 0.0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="eager", attention_dropout=dropout)
    return LlamaForCausalLM(cfg).to(torch.float64)


def _plain_llama_class() -> type:
    from transformers import LlamaForCausalLM

    class PlainLlama(LlamaForCausalLM):
        """A causal LM whose forward takes no **kwargs: the Trainer passes it no num_items_in_batch."""

        def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                    labels: Optional[torch.Tensor] = None) -> Any:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    return PlainLlama


def plain_llama(seed: int = 0, dropout: float = 0.0) -> torch.nn.Module:
    model = llama(seed, dropout)
    model.__class__ = _plain_llama_class()
    return model


def t5(seed: int = 0, dropout: float = 0.0) -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=VOCAB, d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2,
                   decoder_start_token_id=0, pad_token_id=0, dropout_rate=dropout)
    return T5ForConditionalGeneration(cfg).to(torch.float64)


MODELS = {"llama": llama, "plain_llama": plain_llama, "t5": t5}


def make_model(p: Dict[str, Any]) -> torch.nn.Module:
    """The model ``p`` names, from ``model_seed`` (default 0), with ``dropout`` (default 0: none)."""
    return MODELS[p["model"]](p.get("model_seed", 0), p.get("dropout", 0.0))


def dataset_for(p: Dict[str, Any]) -> List[Dict[str, torch.Tensor]]:
    make = seq2seq_dataset if p["model"] == "t5" else causal_dataset
    return make(p["n"], p.get("data_seed", 0), p.get("unsupervised", ()))


# ---- the reference step ------------------------------------------------------------------


def token_loss_sum(model: torch.nn.Module, sample: Dict[str, torch.Tensor], seq2seq: bool) -> tuple:
    """(sum of float64 per-token losses, supervised tokens) of one sample, alone (no padding)."""
    if seq2seq:
        logits = model(input_ids=sample["input_ids"][None], labels=sample["labels"][None]).logits[0]
        labels = sample["labels"]
    else:
        logits = model(input_ids=sample["input_ids"][None]).logits[0][:-1]
        labels = sample["labels"][1:]
    keep = labels != IGNORE
    return F.cross_entropy(logits[keep].double(), labels[keep], reduction="sum"), int(keep.sum())


def reference_delta(p: Dict[str, Any], ids: Sequence[int]) -> Dict[str, torch.Tensor]:
    """-lr x gradient of (sum of token losses) / (tokens) over the samples ``ids``, in one process."""
    model = make_model(p)
    data = dataset_for(p)
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    for i in ids:
        loss, count = token_loss_sum(model, data[i], p["model"] == "t5")
        total, tokens = total + loss, tokens + count
    (total / tokens).backward()
    return {n: -p["lr"] * w.grad for n, w in model.named_parameters() if w.grad is not None}


# ---- Trainer runs ----------------------------------------------------------------------------


def make_args(p: Dict[str, Any], out: str) -> Any:
    from transformers import Seq2SeqTrainingArguments, TrainingArguments

    cls = Seq2SeqTrainingArguments if p["model"] == "t5" else TrainingArguments
    options = dict(output_dir=out, use_cpu=True, report_to="none", disable_tqdm=True, optim="sgd",
                   learning_rate=p["lr"], weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant",
                   gradient_accumulation_steps=p["ga"], max_steps=p.get("max_steps", -1),
                   num_train_epochs=p.get("epochs", 1), save_strategy="no", logging_strategy="no", seed=7,
                   average_tokens_across_devices=p.get("avg_tokens", True), dataloader_num_workers=0)
    options.update(p.get("args", {}))
    return cls(**options)


def build_trainer(p: Dict[str, Any], out: str) -> Any:
    from transformers import Seq2SeqTrainer, Trainer

    from odb.integrations.hf import ODBTrainer, enable_odb

    model = make_model(p)
    odb_options = dict(token_budget=p["budget"], buffer_size=p.get("buffer", 16))
    if not p.get("same_updates"):  # these runs test budget-filled steps, the explicit choice
        odb_options["global_batch_size"] = None
    odb_options.update(p.get("odb", {}))
    data = dataset_for(p)
    if p["model"] == "t5":
        import odb

        trainer = Seq2SeqTrainer(model=model, args=make_args(p, out), train_dataset=data, data_collator=pad_collate)
        return enable_odb(trainer, length_fn=odb.seq2seq_lengths, **odb_options)
    if p.get("enable"):
        return enable_odb(Trainer(model=model, args=make_args(p, out), train_dataset=data,
                                  data_collator=pad_collate), **odb_options)
    return ODBTrainer(model=model, args=make_args(p, out), train_dataset=data, data_collator=pad_collate,
                      **odb_options)


def _join_torch_distributed(rank: int, world: int) -> None:
    # The harness already joined the gloo group; accelerate reads the launcher's variables.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")


def recorder(trainer: Any) -> Any:
    """A callback that records, after every optimizer step: (global_step, epoch, this rank's sample ids, lr)."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.steps: List[tuple] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ids = tuple(i for info in trainer.odb_step_infos for i in info.sample_ids)
            self.steps.append((state.global_step, state.epoch, ids, trainer.lr_scheduler.get_last_lr()[0]))

    trainer.add_callback(Recorder())
    return trainer.callback_handler.callbacks[-1]


def train_ranks(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """Train per ``p``; return this rank's parameter change, last step's infos, steps and log history."""
    if world > 1:
        _join_torch_distributed(rank, world)
    trainer = build_trainer(p, p["out"])
    rec = recorder(trainer)
    before = {n: w.detach().clone() for n, w in trainer.model.named_parameters()}
    trainer.train(resume_from_checkpoint=p.get("resume"))
    delta = {n: w.detach() - before[n] for n, w in trainer.model.named_parameters()}
    return {"delta": delta, "infos": [i.as_dict() for i in trainer.odb_step_infos],
            "ids": sorted(i for info in trainer.odb_step_infos for i in info.sample_ids),
            "log": trainer.state.log_history, "global_step": trainer.state.global_step, "steps": rec.steps,
            "params": {n: w.detach().clone() for n, w in trainer.model.named_parameters()}}


def suite_ranks(rank: int, world: int, p: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Several runs in one set of processes (the interpreter and transformers start once)."""
    return [train_ranks(rank, world, dict(run, out=os.path.join(p["out"], str(k))) if "out" not in run
                        else run) for k, run in enumerate(p["runs"])]



# ---- transformers' own collators (tests/loader/test_first_hour_hf.py) --------------------------------------


def word_tokenizer(mask: bool = False, pad_is_eos: bool = False) -> Any:
    """A WordLevel tokenizer trained offline on examples/_hf_text.py's sentences (with [MASK] for masked LM)."""
    import sys
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from _hf_text import sentences

    special = ["<pad>", "</s>", "<unk>"] + (["[MASK]"] if mask else [])
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(sentences(200, seed=1), trainers.WordLevelTrainer(special_tokens=special))
    extra = {"mask_token": "[MASK]"} if mask else {}
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="</s>" if pad_is_eos else "<pad>",
                                  eos_token="</s>", unk_token="<unk>", padding_side="right", **extra)
    if len(out) > VOCAB:
        raise ValueError(f"the test tokenizer has {len(out)} tokens, more than the models' vocab_size={VOCAB}")
    return out


def text_dataset(tok: Any, n: int = 24, eos: bool = False, label: bool = False, seed: int = 0) -> Any:
    """A datasets.Dataset of tokenized sentences of varied length (as after dataset.map(tokenize))."""
    import sys
    from pathlib import Path

    import datasets

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from _hf_text import sentences

    rows = [tok(t)["input_ids"] + ([tok.eos_token_id] if eos else [])
            for t in sentences(n, seed=seed, low=2, high=20)]
    data: Dict[str, List[Any]] = {"input_ids": rows}
    if label:
        data["label"] = [i % 3 for i in range(n)]
    return datasets.Dataset.from_dict(data)


def bert(kind: str) -> torch.nn.Module:
    """A float64 tiny BERT: masked LM (``kind="mlm"``) or 3-class sequence classification."""
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, num_labels=3, pad_token_id=0)
    cls = BertForMaskedLM if kind == "mlm" else BertForSequenceClassification
    return cls(cfg).to(torch.float64)


def masked_lm_step(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """One optimizer step of a masked LM with DataCollatorForLanguageModeling(mlm=True) under odb: this
    rank's parameter change, step infos and the step's collated micro-batches (the collator draws the
    masked tokens, so the reference is computed from what it drew)."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from odb.integrations.hf import enable_odb

    if world > 1:
        _join_torch_distributed(rank, world)
    batches: List[Dict[str, torch.Tensor]] = []

    class Recorded(DataCollatorForLanguageModeling):
        def __call__(self, features: Any, return_tensors: Any = None) -> Any:
            batch = super().__call__(features, return_tensors)
            batches.append({k: v.clone() for k, v in batch.items()})
            return batch

    tok = word_tokenizer(mask=True)
    args = TrainingArguments(output_dir=p["out"], use_cpu=True, report_to="none", disable_tqdm=True, optim="sgd",
                             learning_rate=p["lr"], weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant",
                             gradient_accumulation_steps=p["ga"], max_steps=1, save_strategy="no",
                             logging_strategy="no", seed=7, dataloader_num_workers=0)
    trainer = enable_odb(Trainer(model=bert("mlm"), args=args, train_dataset=text_dataset(tok, p["n"]),
                                 data_collator=Recorded(tok, mlm=True, mlm_probability=0.3, seed=3 + rank)),
                         token_budget=p["budget"], buffer_size=16, ready_batches=0)
    before = {n: w.detach().clone() for n, w in trainer.model.named_parameters()}
    trainer.train()
    return {"delta": {n: w.detach() - before[n] for n, w in trainer.model.named_parameters()},
            "infos": [i.as_dict() for i in trainer.odb_step_infos],
            "batches": batches[:len(trainer.odb_step_infos)]}  # ready_batches=0: the step's, in order
