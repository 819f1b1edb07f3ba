"""Which of odb's trainer paths a trainer takes, read from its class hierarchy alone (no framework imported).

Three paths, tried in this order:

- ``"rl"``: TRL's ``GRPOTrainer`` or ``RLOOTrainer`` (or a subclass): odb cuts the policy update into
  token-budget micro-batches and leaves TRL's sampler, generation and rewards alone (``odb.integrations.trl.rl``);
- ``"llamafactory"``: a trainer LLaMA-Factory built (a class of the ``llamafactory`` package in its hierarchy):
  odb reads LLaMA-Factory's collator and arguments (``odb.integrations.llamafactory``);
- ``"hf"``: any other transformers ``Trainer`` (``Seq2SeqTrainer``, TRL's ``SFTTrainer``, ``DPOTrainer``,
  ``RewardTrainer``, a user's subclass): odb's loader replaces the Trainer's (``odb.integrations.hf``), TRL's
  rules applied, TRL's trainers odb cannot train exactly refused with the reason.

``odb.enable_odb`` (``odb.integrations.enable``) dispatches by ``trainer_kind``; this module holds the two
paths that every door shares (``enable_rl`` and ``enable_hf``), so that LLaMA-Factory's door can use them
without importing the dispatcher back.

Example:
    >>> trainer_kind(object())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: odb.enable_odb got object, not a transformers.Trainer. Rule: ... Fix: pass the trainer instance; ...
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from odb.config import ODBConfig

KINDS = ("rl", "llamafactory", "hf")
# What odb.integrations.trl.rl.enable_odb_rl takes besides token_budget and packed_attention.
RL_OPTIONS = ("layout", "step_plan")


def _classes(trainer: Any) -> tuple:
    return type(trainer).__mro__


def is_hf_trainer(trainer: Any) -> bool:
    """Whether ``trainer`` is a transformers ``Trainer`` (any subclass), read from its classes' names and modules.

    Example:
        >>> is_hf_trainer(object())
        False
    """
    return any(c.__name__ == "Trainer" and c.__module__.split(".")[0] == "transformers" for c in _classes(trainer))


def is_llamafactory_trainer(trainer: Any) -> bool:
    """Whether a class of LLaMA-Factory's (the ``llamafactory`` package) is in ``trainer``'s hierarchy.

    Example:
        >>> is_llamafactory_trainer(object())
        False
    """
    return any(c.__module__.split(".")[0] == "llamafactory" for c in _classes(trainer))


def trainer_kind(trainer: Any) -> str:
    """``"rl"``, ``"llamafactory"`` or ``"hf"`` (the module docstring says what each means); a ``TypeError`` naming
    the type and the fix for anything that is not a transformers ``Trainer``."""
    if not is_hf_trainer(trainer):
        raise TypeError(f"odb.enable_odb got {type(trainer).__name__}, not a transformers.Trainer. Rule: "
                        f"odb.enable_odb takes a trainer: transformers' Trainer or Seq2SeqTrainer, TRL's SFTTrainer, "
                        f"DPOTrainer, RewardTrainer, GRPOTrainer or RLOOTrainer, LLaMA-Factory's trainers, or a "
                        f"subclass of one. Fix: pass the trainer instance; for a loader of your own loop use "
                        f"odb.ODBDataLoader or odb.apply(loader, token_budget=...).")
    from odb.integrations.trl.rl import is_rl_trainer

    if is_rl_trainer(trainer):
        return "rl"
    return "llamafactory" if is_llamafactory_trainer(trainer) else "hf"


def enable_rl(trainer: Any, token_budget: Any, config: Optional[ODBConfig], lengths: Optional[Sequence[int]],
              packed_attention: str, options: Dict[str, Any]) -> Any:
    """The ``"rl"`` path: ``odb.integrations.trl.rl.enable_odb_rl`` after refusing what it does not take (odb cuts the
    policy update, not a loader: loader options, ``config`` and ``lengths`` have nothing to act on)."""
    from odb.integrations.trl.rl import enable_odb_rl

    extra = sorted(set(options) - set(RL_OPTIONS))
    extra += [k for k, v in (("config", config), ("lengths", lengths)) if v is not None]
    if extra:
        raise TypeError(f"odb.enable_odb got {extra} for {type(trainer).__name__}, which takes token_budget, layout, "
                        f"step_plan and packed_attention only: odb cuts its policy update, not its loader. Fix: pass "
                        f"those alone.")
    return enable_odb_rl(trainer, token_budget, layout=options.get("layout", "padded"),
                         step_plan=options.get("step_plan", "auto"), packed_attention=packed_attention)


def enable_hf(trainer: Any, token_budget: Any, config: Optional[ODBConfig], lengths: Optional[Sequence[int]],
              packed_attention: str, options: Dict[str, Any]) -> Any:
    """The ``"hf"`` path: ``odb.integrations.hf.trainer.enable_odb`` (odb's loader in the Trainer, TRL's rules)."""
    from odb.integrations.hf.trainer import enable_odb

    return enable_odb(trainer, token_budget, config=config, lengths=lengths, packed_attention=packed_attention,
                      **options)
