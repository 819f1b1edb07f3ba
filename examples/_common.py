"""Shared pieces of the examples: a synthetic tokenized dataset, a pad collate, a tiny LM."""

from __future__ import annotations

from typing import Dict, List

import torch
from torch.utils.data import Dataset

from odb.bench.workloads import lognormal_lengths


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
    """A 2-layer Llama-like LM with random weights (built from a config, no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048)
    return LlamaForCausalLM(cfg)
