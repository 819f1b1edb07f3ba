"""odb in TRL's ``GRPOTrainer`` and ``RLOOTrainer``: the policy update cut into micro-batches by tokens.

TRL's sampler, generation (transformers, or vLLM in server or colocate mode), rewards, advantages and
group structure stay TRL's. TRL still hands each training step its slice of the generation batch
(``steps_per_generation`` equal slices, reused ``num_iterations`` times); odb replaces the one forward
and backward pass over that slice, padded to the generation batch's longest prompt and completion, by
as many passes as the rows need: micro-batches under ``token_budget`` tokens, each run without the
gap TRL leaves between a short prompt and its completion (``odb.integrations.trl.rl_forward``):
``layout="padded"`` right-pads each row to the micro-batch's longest prompt plus completion,
``layout="packed"`` runs the micro-batch's rollouts as one packed row (no padding; the model is
switched to odb's per-sample attention and probed, as for SFT's packed rows). TRL's own
``compute_loss`` runs on each micro-batch, each row's gradient weighted by its share of its own
slice's loss and the value made that share (``odb.integrations.trl.rl_loss``): the gradient and the
reported loss are TRL's, for every ``loss_type``, with the KL term, the entropy bonus, the importance
ratios and vLLM's sampling correction; TRL's logged metrics are recombined to TRL's values
(``odb.integrations.trl.rl_metrics``). Every value of the rollouts is cut with its row, from odb's list
of TRL's keys (``odb.integrations.trl.rl_rows``); the TRL names odb relies on are checked at the call
and after each loss call (``odb.private_api``). ``odb.integrations.trl.rl_steps`` runs it.

Across ranks every rank gathers every rank's row lengths and loss tokens (one small collective per
step, through odb's exchange) and computes the same plan, by ``step_plan``:

- ``"global"`` (``odb.plan.rollouts.across_ranks``): rows move between ranks so that every rank's
  update costs about the same; each rank sends the others the rows they train, once
  (``odb.integrations.trl.rl_move``, one all-to-all of bytes through odb's exchange), and
  TRL's per-row metric gathers take each rank's own row count (``ragged_gather``);
- ``"rank"`` (``odb.plan.rollouts.per_rank``): rows stay; the same number of rows in each
  micro-step on every rank;
- ``"auto"`` (default): ``"global"`` on several ranks, ``"rank"`` on one.

Either way every rank runs the same number of micro-steps, none empty (TRL's loss holds
collectives and cannot run on zero rows), so no rank needs a ghost pass. Every micro-batch but
the last runs under ``no_sync``: gradients are all-reduced once per step.

Example:
    >>> from trl import GRPOConfig, GRPOTrainer                                  # doctest: +SKIP
    >>> from odb.integrations.trl import enable_odb                              # doctest: +SKIP
    >>> trainer = enable_odb(GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
    ...                                  train_dataset=prompts), token_budget=8192)  # doctest: +SKIP
    >>> trainer.train()                                                          # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import numpy as np

from odb.comm.dist import world
from odb.integrations.trl.rl_loss import RL_MODULES, check_rl_settings
from odb.integrations.trl.rl_steps import RolloutCounts, RolloutMicroSteps
from odb.plan.rollouts.per_rank import ROLLOUT_LAYOUTS

__all__ = ["STEP_PLANS", "RolloutCounts", "RolloutMicroSteps", "enable_odb_rl", "is_rl_trainer",
           "resolve_step_plan"]

STEP_PLANS = ("auto", "global", "rank")


def resolve_step_plan(step_plan: str, name: str, world_size: int) -> str:
    """The plan ``step_plan`` asks for on ``world_size`` ranks: ``"global"`` or ``"rank"``. ``"auto"`` is
    ``"global"`` on several ranks (rows move, for every loss: each row carries its own slice's normaliser), else
    ``"rank"``.

    Example:
        >>> [resolve_step_plan("auto", "GRPOTrainer", w) for w in (2, 1)], resolve_step_plan("rank", "GRPOTrainer", 8)
        (['global', 'rank'], 'rank')
    """
    if step_plan not in STEP_PLANS:
        raise ValueError(f"odb got step_plan={step_plan!r} for {name}. Rule: one of {STEP_PLANS}. Fix: pass "
                         f"step_plan='auto' (default: rows move between ranks on several), 'global' or 'rank'.")
    if step_plan == "auto":
        return "global" if world_size > 1 else "rank"
    return step_plan


def enable_odb_rl(trainer: Any, token_budget: int, *, layout: str = "padded", step_plan: str = "auto",
                  packed_attention: str = "odb_varlen", exchange_timeout_s: float = 1800.0) -> Any:
    """Cut a TRL ``GRPOTrainer``'s or ``RLOOTrainer``'s policy update into micro-batches of at most
    ``token_budget`` tokens, in place; returns the trainer (``trainer.odb_rl`` holds the
    ``RolloutMicroSteps``). Call it on every rank, before ``train()``.

    ``layout``: ``"padded"`` (rows right-padded to the micro-batch's longest rollout) or
    ``"packed"`` (one packed row per micro-batch: the model must keep packed samples apart;
    ``packed_attention`` as in ``odb.packed.models.prepare_packed_model``: ``"odb_varlen"``
    switches an ``sdpa``/``eager`` model to odb's per-sample attention, ``"model"`` keeps its own).

    ``step_plan``: ``"auto"`` (default), ``"global"`` (rows move between ranks) or ``"rank"`` (rows stay),
    as the module docstring says; the plan taken is ``trainer.odb_rl.step_plan``.

    Settings whose loss odb cannot split exactly are refused (``ValueError`` naming the setting,
    the reason and the fix; ``odb.integrations.trl.rl_loss.check_rl_settings``), and so is a TRL whose names
    odb relies on are missing or changed (``odb.private_api.FrameworkDrift``).

    Example:
        >>> enable_odb_rl(object(), token_budget=4096)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: odb.integrations.trl.rl.enable_odb_rl got object, not a TRL GRPOTrainer or RLOOTrainer. ...
    """
    name, kind = check_rl_settings(trainer)
    if isinstance(token_budget, bool) or not isinstance(token_budget, (int, np.integer)) or token_budget < 1:
        raise ValueError(f"odb got token_budget={token_budget!r} for {name}. Rule: the padded tokens of one "
                         f"micro-batch, a positive integer. Fix: pass e.g. token_budget=8192.")
    longest = int(trainer.max_completion_length) + 1
    if token_budget < longest:
        raise ValueError(f"odb got token_budget={token_budget} for {name} with max_completion_length="
                         f"{longest - 1}. Rule: a micro-batch holds at least one rollout, a prompt and a completion "
                         f"of up to max_completion_length tokens. Fix: token_budget >= the longest prompt plus "
                         f"max_completion_length (e.g. {4 * longest}).")
    if isinstance(getattr(trainer, "odb_rl", None), RolloutMicroSteps):
        raise ValueError(f"odb is already enabled on this {name} (trainer.odb_rl). Rule: enable it once. Fix: drop "
                         f"the second call, or build a new trainer for another token_budget.")
    if layout not in ROLLOUT_LAYOUTS:
        raise ValueError(f"odb got layout={layout!r} for {name}. Rule: one of {ROLLOUT_LAYOUTS}. Fix: pass "
                         f"layout='padded' (default) or layout='packed'.")
    plan = resolve_step_plan(step_plan, name, world()[1])
    if layout == "packed":
        from odb.packed.models import prepare_packed_model

        policy = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
        prepare_packed_model(policy, attention=packed_attention)  # refuses a model that mixes packed samples
    steps = RolloutMicroSteps(trainer, name, kind, int(token_budget), exchange_timeout_s, layout, plan)
    trainer.odb_rl = steps
    trainer.compute_loss = steps.compute_loss  # the Trainer's training_step calls it, then backward on its loss
    return trainer


def is_rl_trainer(trainer: Any) -> bool:
    """Whether ``trainer`` is a TRL ``GRPOTrainer`` or ``RLOOTrainer`` (or a subclass of one).

    Example:
        >>> is_rl_trainer(object())
        False
    """
    return any(RL_MODULES.get(c.__name__) == c.__module__ for c in type(trainer).__mro__)
