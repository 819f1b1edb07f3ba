"""``odb.enable_odb(trainer, token_budget=...)``: one call for every trainer odb trains.

It dispatches by the trainer's type (``odb.integrations.trainer_kinds``), importing the path it takes only
then (``import odb`` imports no training framework):

- transformers ``Trainer``, ``Seq2SeqTrainer`` or a subclass: its loader becomes odb's (``odb.integrations.hf``);
- TRL's ``SFTTrainer``, ``DPOTrainer``, ``RewardTrainer``: the same, with TRL's labels, padding-free rows and
  preference pairs (``odb.integrations.trl``);
- TRL's ``GRPOTrainer``, ``RLOOTrainer``: the policy update cut into token-budget micro-batches, TRL's sampler
  and generation left alone (``odb.integrations.trl.rl``);
- LLaMA-Factory's trainers (``CustomSeq2SeqTrainer``): odb's loader, with the settings read from
  LLaMA-Factory's collator and arguments (``odb.integrations.llamafactory``).

``odb.integrations.hf.enable_odb``, ``odb.integrations.trl.enable_odb`` and
``odb.integrations.llamafactory.enable_odb(trainer=...)`` are the same call: each takes every trainer above.
TRL's trainers that odb cannot train exactly (CPO, ORPO, KTO, online DPO...) are refused with the reason and
the fix, before anything changes.

Example:
    >>> import odb
    >>> odb.enable_odb(object(), token_budget=4096)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: odb.enable_odb got object, not a transformers.Trainer. ...
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from odb.config import ODBConfig
from odb.integrations.trainer_kinds import enable_hf, enable_rl, trainer_kind

__all__ = ["enable_odb"]


def enable_odb(trainer: Any, token_budget: Any = None, *, config: Optional[ODBConfig] = None,
               lengths: Optional[Sequence[int]] = None, packed_attention: str = "odb_varlen",
               **odb_options: Any) -> Any:
    """Switch ``trainer`` to odb batches, in place; returns it. Call it on every rank, before ``train()``.

    ``token_budget``: the most padded tokens per micro-batch (``"auto"`` where the trainer's path supports it).
    Every other keyword is an ``odb.ODBConfig`` field (``config`` holds them all), except for TRL's GRPO and RLOO,
    which take ``layout`` and ``step_plan`` only (``odb.integrations.trl.rl.enable_odb_rl``). ``lengths``: the
    samples' lengths when known; ``packed_attention``: ``"odb_varlen"`` switches an sdpa/eager model to odb's
    per-sample attention for packed rows, ``"model"`` keeps its own.

    Example:
        >>> import odb                                                           # doctest: +SKIP
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collate)  # doctest: +SKIP
        >>> odb.enable_odb(trainer, token_budget=16384).train()                  # doctest: +SKIP
    """
    kind = trainer_kind(trainer)
    options = dict(odb_options)
    if kind == "rl":
        return enable_rl(trainer, token_budget, config, lengths, packed_attention, options)
    if kind == "llamafactory":
        from odb.integrations.llamafactory import enable_odb as enable_llamafactory

        return enable_llamafactory(trainer=trainer, token_budget=token_budget, config=config, lengths=lengths,
                                   packed_attention=packed_attention, **options)
    return enable_hf(trainer, token_budget, config, lengths, packed_attention, options)
