"""Offline text for the HF Trainer examples: sentences of varied length and a tokenizer trained on them.

No download: the tokenizer is a WordLevel model trained with ``tokenizers`` on the
generated sentences and wrapped in ``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

import random
from typing import Any, List

from torch.utils.data import Dataset

WORDS = ("the cat dog bird sees runs jumps over under a small large red blue green house tree river boat "
         "quickly slowly today yesterday and but with near far old new happy sad").split()


def sentences(n: int, seed: int = 0, low: int = 2, high: int = 60) -> List[str]:
    """n sentences whose word counts are log-uniform in [low, high] (many short, some long)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = int(round(low * (high / low) ** rng.random()))
        out.append(" ".join(rng.choice(WORDS) for _ in range(words)))
    return out


def train_tokenizer(texts: List[str]):
    """A PreTrainedTokenizerFast (WordLevel, whitespace) with pad/eos/unk tokens, trained on ``texts``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<pad>", "</s>", "<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   padding_side="right")


class TokenizedTexts(Dataset):
    """A map-style dataset over ``texts`` that tokenizes an item when it is read (in the loader's workers)."""

    def __init__(self, texts: List[str], tokenizer: Any) -> None:
        self.texts, self.tokenizer = texts, tokenizer

    def __len__(self) -> int:
        return len(self.texts)
