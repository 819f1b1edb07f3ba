"""Real text for the training benchmark, and its three length workloads.

The text is the English of Python's own documentation topics (``pydoc_data.topics``,
shipped with every CPython: ~460 KB), tokenized byte by byte (vocabulary 256, id 0 is
the padding and never occurs in the text). A sample of length L is L consecutive bytes
of that text from a seeded offset, so a tiny model's loss falls from ln(256) = 5.5
while it learns English, and every arm trains on the same tokens. The last tenth of
the text is held out for evaluation.

Workloads (lengths in tokens, deterministic, each arm sees the same ones):

- ``short-pairs``: source + target lengths of the committed English->German gettext
  message pairs (GPT-2 tokens, mean ~36), truncated at 256 as a translation recipe does;
- ``heavy-tailed``: the instruction-mix log-normal (mean 900, CV 1.0) divided by 4,
  truncated at 1,024;
- ``long-chat``: the committed ShareGPT conversation lengths (GPT-2 tokens, mean
  ~1,690) divided by 4, truncated at 1,024.

Example:
    >>> data = TextSamples([5, 3])
    >>> [len(data[i]["input_ids"]) for i in range(2)], int(data[0]["input_ids"].min()) > 0
    ([5, 3], True)
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from odb.bench.workloads import lognormal_lengths

VOCAB = 256
PAD_ID = 0
HELD_OUT = 0.1  # the last tenth of the text: evaluation only

# name -> (description, divisor of the source lengths, truncation)
WORKLOADS: Dict[str, tuple] = {
    "short-pairs": ("gettext en->de pairs, source + target (GPT-2 tokens)", 1, 256),
    "heavy-tailed": ("instruction mix, log-normal mean 900 CV 1.0", 4, 1024),
    "long-chat": ("ShareGPT conversations (GPT-2 tokens)", 4, 1024),
}


@functools.lru_cache(maxsize=1)
def corpus() -> torch.Tensor:
    """The whole text as int64 byte ids (1-D)."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)


def _split() -> int:
    return int(len(corpus()) * (1.0 - HELD_OUT))


class TextSamples(Dataset):
    """Sample i: ``lengths[i]`` bytes of the text from a seeded offset of the training part, as
    ``{"input_ids": ids, "labels": ids}``."""

    def __init__(self, lengths: Sequence[int], seed: int = 0) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        room = _split() - int(self.lengths.max(initial=1))
        if room <= 0:
            raise ValueError(f"TextSamples: a sample of {int(self.lengths.max())} tokens does not fit the "
                             f"{_split()}-token training text. Fix: truncate samples below that length.")
        self.offsets = np.random.default_rng(seed).integers(0, room, size=len(self.lengths))
        self.text = corpus()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        start = int(self.offsets[i])
        ids = self.text[start:start + int(self.lengths[i])]
        return {"input_ids": ids, "labels": ids}  # a causal LM's labels: its inputs (the model shifts them)


def held_out_batch(samples: int = 16, length: int = 256) -> Dict[str, torch.Tensor]:
    """A fixed evaluation batch: ``samples`` evenly spaced windows of the held-out text."""
    text, start = corpus(), _split()
    offsets = np.linspace(start, len(text) - length, samples).astype(np.int64)
    ids = torch.stack([text[o:o + length] for o in offsets.tolist()])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def pad_collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Right-pad input_ids; attention_mask marks real tokens; labels are -100 on padding."""
    ids = torch.nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], batch_first=True, padding_value=PAD_ID)
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _subsample(x: np.ndarray, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return x[rng.choice(len(x), size=n, replace=len(x) < n)]


def _scaling(name: str, full_length: bool) -> tuple:
    _, divisor, cap = WORKLOADS[name]
    return (1, cap * divisor) if full_length else (divisor, cap)


def workload_lengths(name: str, n: int, seed: int = 0, full_length: bool = False) -> np.ndarray:
    """n lengths of workload ``name`` (a key of ``WORKLOADS``), scaled and truncated as it says.

    ``full_length``: the source lengths undivided, truncated at the divisor x the truncation (a GPU run).

    Example:
        >>> x = workload_lengths("heavy-tailed", 100)
        >>> len(x), int(x.min()) >= 16, int(x.max()) <= 1024
        (100, True, True)
    """
    if name not in WORKLOADS:
        raise KeyError(f"unknown training workload {name!r}; known: {sorted(WORKLOADS)}")
    divisor, cap = _scaling(name, full_length)
    if name == "heavy-tailed":
        raw = lognormal_lengths(900.0, 1.0, n, seed)
    else:
        from odb.bench.realdata import load_real_lengths

        real = load_real_lengths("gettext-en-de" if name == "short-pairs" else "sharegpt-gpt2")
        raw = _subsample(np.asarray(real, dtype=np.int64).reshape(len(real), -1).sum(axis=1), n, seed)
    return np.clip(-(-raw // divisor), 16 if divisor > 1 else 2, cap).astype(np.int64)


def describe(name: str, full_length: bool = False) -> Dict[str, Any]:
    """What the table says about a workload: its source, scaling and truncation."""
    divisor, cap = _scaling(name, full_length)
    return {"source": WORKLOADS[name][0], "divided_by": divisor, "truncation": cap}
