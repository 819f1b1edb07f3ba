"""Batched ``model.generate()`` under a token budget, with an out-of-memory fallback.

``generate_batched`` groups inputs by length with odb's planner (cost of a batch: rows
x (longest input + max_new_tokens)), runs each group through
``generate_with_oom_fallback`` and returns one output per input, in input order, cut
as an unbatched ``generate`` would return it. ``generate_with_oom_fallback`` halves
only a batch that ran out of memory (recursively) and joins the halves' outputs in
order, right-padded with the pad token. Works with any model whose ``generate``
returns a tensor of token ids (Hugging Face decoder-only and encoder-decoder models).
See docs/oom-and-generation.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, List, Literal, Optional, Sequence, Set, Union

import numpy as np
import torch

from odb.config import ODBConfig
from odb.train.oom import OOM_ERRORS, ODBOOMError, PaddedBatchSplitter, release_memory
from odb.plan.windows.window import oracle_groups

GenerationInput = Union[Sequence[int], torch.Tensor, Mapping]
_ROWS = PaddedBatchSplitter(mask_keys=())  # selects rows of every row-first value, trims nothing


def generate_with_oom_fallback(model: Any, batch: Union[Mapping, torch.Tensor], *, pad_token_id: Optional[int] = None,
                               **generate_kwargs: Any) -> torch.Tensor:
    """``model.generate(**batch, **generate_kwargs)``; on out-of-memory, the same on each half of the rows.

    Only a batch that failed is split; outputs come back in row order, right-padded
    with ``pad_token_id`` (default: the model's generation config pad, else its EOS).

    Example:
        >>> class Echo:  # a stand-in for a Hugging Face model: appends one token per row
        ...     def generate(self, input_ids, **kwargs):
        ...         return torch.cat([input_ids, input_ids[:, :1]], 1)
        >>> generate_with_oom_fallback(Echo(), {"input_ids": torch.tensor([[5, 6], [7, 8]])}, pad_token_id=0,
        ...                            max_new_tokens=1).tolist()
        [[5, 6, 5], [7, 8, 7]]
    """
    if isinstance(batch, torch.Tensor):
        batch = {"input_ids": batch}
    if generate_kwargs.get("return_dict_in_generate"):
        raise ValueError("return_dict_in_generate=True: generate_with_oom_fallback joins token-id tensors only. "
                         "Fix: leave return_dict_in_generate unset.")
    pad = _pad_id(model, pad_token_id)
    kwargs = dict(generate_kwargs, pad_token_id=pad) if pad is not None else generate_kwargs
    outputs = _generate(model, batch, list(range(_ROWS.rows(batch))), kwargs)
    width = max(int(o.shape[1]) for o in outputs)
    if pad is None and any(int(o.shape[1]) != width for o in outputs):
        raise ValueError("the halves of a split batch generated different lengths and the model defines no pad "
                         "token to join them. Fix: pass pad_token_id=<id>.")
    return torch.cat([torch.nn.functional.pad(o, (0, width - int(o.shape[1])), value=pad or 0) for o in outputs])


def _generate(model: Any, batch: Mapping, rows: List[int], kwargs: Dict[str, Any]) -> List[torch.Tensor]:
    piece = batch if len(rows) == _ROWS.rows(batch) else _ROWS.take(batch, rows)
    oom = False
    try:
        out = model.generate(**piece, **kwargs)
    except OOM_ERRORS:
        oom = True
    if not oom:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"model.generate returned {type(out).__name__}, not a tensor of token ids. Fix: call "
                            f"without return_dict_in_generate / output_scores.")
        return [out]
    del piece
    release_memory()
    if len(rows) == 1:
        raise ODBOOMError(f"odb: generating for a single input (row {rows[0]} of the batch) ran out of memory; it "
                          f"cannot be split further. Fix: lower max_new_tokens or the input length.")
    half = len(rows) // 2
    return _generate(model, batch, rows[:half], kwargs) + _generate(model, batch, rows[half:], kwargs)


def plan_generation_batches(lengths: Sequence[int], *, token_budget: int, max_new_tokens: int,
                            max_batch_size: Optional[int] = None,
                            oversize: Literal["error", "alone"] = "error") -> List[List[int]]:
    """Groups of input positions such that rows x (longest input + max_new_tokens) <= token_budget.

    odb's oracle planner (all lengths known: sorted longest first, cut greedily). An
    input that alone exceeds the budget raises (``oversize="error"``) or gets its own
    batch (``"alone"``).

    Example:
        >>> plan_generation_batches([3, 10, 4, 9], token_budget=40, max_new_tokens=10)
        [[1, 3], [2, 0]]
    """
    if oversize not in ("error", "alone"):
        raise ValueError(f"oversize={oversize!r}: must be 'error' or 'alone'. Fix: pass one of them.")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an int >= 0. Fix: pass e.g. 128.")
    cfg = ODBConfig(token_budget=token_budget, max_batch_size=max_batch_size)
    cost = np.asarray(lengths, dtype=np.int64).reshape(-1) + max_new_tokens
    big = np.flatnonzero(cost > token_budget)
    if len(big) and oversize == "error":
        raise ValueError(f"input {int(big[0])} has {int(cost[big[0]]) - max_new_tokens} tokens; with "
                         f"max_new_tokens={max_new_tokens} it alone exceeds token_budget={token_budget} "
                         f"({len(big)} input(s) do). Fix: raise token_budget, lower max_new_tokens or pass "
                         f"oversize='alone'.")
    fits = np.flatnonzero(cost <= token_budget)
    groups = [[int(i)] for i in big[np.argsort(-cost[big], kind="stable")]]
    return groups + [fits[g].tolist() for g in oracle_groups(cost[fits], cfg)]


def generate_batched(model: Any, inputs: Sequence[GenerationInput], *, token_budget: int, max_new_tokens: int,
                     pad_token_id: Optional[int] = None, padding_side: Optional[Literal["left", "right"]] = None,
                     max_batch_size: Optional[int] = None, oversize: Literal["error", "alone"] = "error",
                     **generate_kwargs: Any) -> List[torch.Tensor]:
    """Generate for many inputs in length-grouped batches; one 1-D tensor per input, in input order.

    Args:
        model: a model with ``generate`` (Hugging Face decoder-only or encoder-decoder).
        inputs: token-id lists, 1-D tensors, or dicts of 1-D per-token fields holding
            ``input_ids`` (and e.g. ``attention_mask``).
        token_budget: the most rows x (longest input + max_new_tokens) of one batch.
        max_new_tokens: passed to generate; also the planned output length.
        pad_token_id: pads inputs and outputs (default: the model's pad, else its EOS).
        padding_side: "left" for decoder-only models, "right" for encoder-decoder
            (default from ``model.config.is_encoder_decoder``).
        max_batch_size, oversize: see ``plan_generation_batches``.
        **generate_kwargs: passed to ``generate`` (greedy decoding is deterministic).

    Each output is what ``model.generate`` returns for that input alone (the prompt
    plus new tokens for decoder-only models, the decoder sequence for encoder-decoder
    ones), cut after the first EOS among the new tokens.

    Example:
        >>> class Echo:  # a stand-in for a decoder-only model: appends the first prompt token
        ...     config = None
        ...     def generate(self, input_ids, attention_mask, **kwargs):
        ...         return torch.cat([input_ids, input_ids[:, -1:]], 1)
        >>> [t.tolist() for t in generate_batched(Echo(), [[5, 6], [7]], token_budget=8, max_new_tokens=1,
        ...                                       pad_token_id=0)]
        [[5, 6, 6], [7, 7]]
    """
    if generate_kwargs.get("num_return_sequences", 1) != 1:
        raise ValueError("num_return_sequences != 1: generate_batched returns one output per input. Fix: call "
                         "generate_with_oom_fallback on a batch you build, or leave it at 1.")
    rows = [_as_fields(x, i) for i, x in enumerate(inputs)]
    lengths = [len(r["input_ids"]) for r in rows]
    pad = _pad_id(model, pad_token_id)
    if pad is None:
        raise ValueError("the model defines neither a pad nor an EOS token to pad inputs with. Fix: pass "
                         "pad_token_id=<id>.")
    enc_dec = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    side = padding_side or ("right" if enc_dec else "left")
    if side not in ("left", "right"):
        raise ValueError(f"padding_side={side!r}: must be 'left' or 'right'. Fix: pass 'left' for decoder-only "
                         f"models, 'right' for encoder-decoder ones.")
    eos = _eos_ids(model, generate_kwargs.get("eos_token_id"))
    results: List[Optional[torch.Tensor]] = [None] * len(rows)
    for group in plan_generation_batches(lengths, token_budget=token_budget, max_new_tokens=max_new_tokens,
                                         max_batch_size=max_batch_size, oversize=oversize):
        width = max(lengths[i] for i in group)
        batch = _collate([rows[i] for i in group], width, pad, side)
        out = generate_with_oom_fallback(model, batch, pad_token_id=pad, max_new_tokens=max_new_tokens,
                                         **generate_kwargs)
        for row, i in enumerate(group):
            start = width - lengths[i] if side == "left" and not enc_dec else 0
            new_from = width if not enc_dec else 1  # after the prompt, or after the decoder start token
            results[i] = _cut_after_eos(out[row], new_from, eos)[start:]
    return results  # type: ignore[return-value]


def _as_fields(x: GenerationInput, index: int) -> Dict[str, torch.Tensor]:
    fields = dict(x) if isinstance(x, Mapping) else {"input_ids": x}
    if "input_ids" not in fields:
        raise ValueError(f"input {index} is a dict without input_ids (keys {list(fields)}). Fix: give each input "
                         f"its token ids under input_ids.")
    out = {k: torch.as_tensor(v).reshape(-1) if not isinstance(v, torch.Tensor) else v for k, v in fields.items()}
    n = len(out["input_ids"])
    bad = [k for k, v in out.items() if v.dim() != 1 or len(v) != n]
    if bad or n == 0:
        raise ValueError(f"input {index}: every field must be 1-D with one value per token ({n} tokens); "
                         f"{bad or ['input_ids']} is not (or the input is empty). Fix: pass token-id lists or dicts "
                         f"of per-token 1-D fields.")
    out.setdefault("attention_mask", torch.ones(n, dtype=torch.long))
    return out


def _collate(rows: List[Dict[str, torch.Tensor]], width: int, pad: int, side: str) -> Dict[str, torch.Tensor]:
    batch = {}
    for key in rows[0]:
        value = torch.full((len(rows), width), pad if key == "input_ids" else 0, dtype=rows[0][key].dtype)
        for r, row in enumerate(rows):
            n = len(row[key])
            if side == "left":
                value[r, width - n:] = row[key]
            else:
                value[r, :n] = row[key]
        batch[key] = value
    return batch


def _cut_after_eos(row: torch.Tensor, new_from: int, eos: Set[int]) -> torch.Tensor:
    if eos:
        hits = torch.isin(row[new_from:], torch.tensor(sorted(eos), device=row.device)).nonzero()
        if len(hits):
            return row[:new_from + int(hits[0]) + 1]
    return row


def _pad_id(model: Any, given: Optional[int]) -> Optional[int]:
    if given is not None:
        return int(given)
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(source, "pad_token_id", None)
        if value is not None:
            return int(value)
    eos = sorted(_eos_ids(model, None))
    return eos[0] if eos else None


def _eos_ids(model: Any, given: Any) -> Set[int]:
    value = given if given is not None else getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, (list, tuple)) else [value])}
