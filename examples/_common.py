"""Shared pieces of the examples: real text that ships with Python (``DocText``), a synthetic tokenized dataset,
a pad collate, a tiny LM, and a record of the loss per optimizer step (``StepLosses``)."""

from __future__ import annotations

import re
from typing import Dict, List, Optional

import torch
from torch.utils.data import Dataset

from odb.bench.workloads import lognormal_lengths


class DocText(Dataset):
    """Real English: the paragraphs of Python's own documentation topics (``pydoc_data.topics``, shipped with every
    CPython), one sample each, tokenized byte by byte (ids 1-256; 0 is the padding), truncated at ``max_len``.
    Their lengths vary as real text does (16 to ``max_len`` bytes, median about 120), and a tiny LM's loss falls
    from ln(257) = 5.5 as it learns English.

    Example:
        >>> data = DocText(n=3)
        >>> len(data), int(data[0]["input_ids"].min()) >= 1, data[0]["labels"].equal(data[0]["input_ids"])
        (3, True, True)
    """

    VOCAB = 257

    def __init__(self, n: Optional[int] = None, max_len: int = 512) -> None:
        import pydoc_data.topics as topics

        paragraphs = [p.strip() for key in sorted(topics.topics) for p in re.split(r"\n\s*\n", topics.topics[key])]
        self.texts = [p.encode("utf-8")[:max_len] for p in paragraphs if len(p.encode("utf-8")) >= 16][:n]

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        ids = torch.tensor(list(self.texts[i]), dtype=torch.long) + 1
        return {"input_ids": ids, "labels": ids.clone()}  # a causal LM's labels: its inputs (the model shifts them)


class StepLosses:
    """The loss of each optimizer step: the sum of its micro-batches' scaled losses (``odb.scale_loss``), which is
    the token mean over the whole step (on several ranks, this rank's share of it)."""

    def __init__(self) -> None:
        self.steps: List[float] = []
        self._open = 0.0

    def add(self, scaled_loss: float, last_micro_step: bool) -> None:
        self._open += scaled_loss
        if last_micro_step:
            self.steps.append(self._open)
            self._open = 0.0

    def trend(self, k: int = 5) -> str:
        """'loss 5.41 (first 5 steps) -> 3.02 (last 5 steps)'."""
        first, last = self.steps[:k], self.steps[-k:]
        return (f"loss {sum(first) / len(first):.3f} (first {len(first)} steps) -> {sum(last) / len(last):.3f} "
                f"(last {len(last)} steps)")


class SyntheticSFT(Dataset):
    """Tokenized samples of log-normal length; the first quarter of each is a masked prompt."""

    def __init__(self, n: int = 2000, mean: float = 300, cv: float = 1.0, max_len: int = 1024, vocab: int = 1000,
                 seed: int = 0) -> None:
        self.lengths = lognormal_lengths(mean, cv, n, seed).clip(max=max_len)
        self.vocab, self.seed = vocab, seed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ids = torch.randint(0, self.vocab, (int(self.lengths[i]),), generator=g)
        labels = ids.clone()
        labels[: len(ids) // 4] = -100
        return {"input_ids": ids, "labels": labels}


def pad_collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Right-pad input_ids with 0 and labels with -100; attention_mask marks real tokens."""
    width = max(len(s["input_ids"]) for s in samples)
    out = {"input_ids": torch.zeros(len(samples), width, dtype=torch.long),
           "labels": torch.full((len(samples), width), -100, dtype=torch.long),
           "attention_mask": torch.zeros(len(samples), width, dtype=torch.long)}
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        out["input_ids"][row, :n] = s["input_ids"]
        out["labels"][row, :n] = s["labels"]
        out["attention_mask"][row, :n] = 1
    return out


def tiny_llama(vocab: int = 1000) -> torch.nn.Module:
    """A 2-layer Llama-like LM with random weights (built from a config, no download); ``DocText.VOCAB`` for bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048)
    return LlamaForCausalLM(cfg)
