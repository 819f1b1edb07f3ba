"""odb in TRL's ``GRPOTrainer`` and ``RLOOTrainer``: the policy update cut into micro-batches by tokens.

TRL's sampler, generation, rewards, advantages and group structure stay TRL's. TRL still
hands each training step its slice of the generation batch (``steps_per_generation``
equal slices, reused ``num_iterations`` times); odb replaces the one forward and backward
pass over that slice, padded to the generation batch's longest prompt and completion, by
as many passes as the rows need: micro-batches under ``token_budget`` tokens, each run
without the gap TRL leaves between a short prompt and its completion
(``odb.integrations.trl_rl_forward``): ``layout="padded"`` right-pads each row to the
micro-batch's longest prompt plus completion, ``layout="packed"`` runs the micro-batch's
rollouts as one packed row (no padding; the model is switched to odb's per-sample
attention and probed, as for SFT's packed rows). TRL's own ``compute_loss`` runs on each
micro-batch, times the factor that makes it that micro-batch's share of TRL's loss on the
slice (``odb.integrations.trl_rl_loss``): the gradient and the reported loss are TRL's, for
every ``loss_type``, with the KL term, the entropy bonus and the importance ratios.

Across ranks every rank gathers every rank's row lengths (one small collective per step,
through odb's exchange) and computes the same plan, by ``step_plan``:

- ``"global"`` (``odb.plan.rollout_global``): rows move between ranks so that every rank's
  update costs about the same; each rank sends the others the rows they train, once
  (``odb.integrations.trl_rl_move``, one all-to-all of bytes through odb's exchange), and
  TRL's per-row metric gathers take each rank's own row count (``ragged_gather``). Exact for
  the losses whose normaliser does not depend on the rank a row came from (every loss_type
  but ``bnpo``, without the entropy bonus: ``odb.integrations.trl_rl_loss``);
- ``"rank"`` (``odb.plan.rollout_plan``): rows stay; the same number of rows in each
  micro-step on every rank;
- ``"auto"`` (default): ``"global"`` on several ranks where the loss allows it, else ``"rank"``.

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

import collections
import dataclasses
import contextlib
from typing import Any, Callable, Deque, Dict, Optional, Tuple, Union

import numpy as np

from odb.comm.dist import GroupExchanges, world
from odb.comm.protocol import RankExchange
from odb.integrations.trl_pairs import ragged_gather
from odb.integrations.trl_rl_forward import RolloutForward
from odb.integrations.trl_rl_loss import RL_MODULES, SliceNormaliser, check_rl_settings, loss_mask, rows_stay_home
from odb.integrations.trl_rl_move import micro_batch, move_rows
from odb.integrations.trl_rl_rows import check_rollout_keys, rollout_lengths, take_rows
from odb.plan.rollout_global import GlobalRolloutPlan, plan_rollout_global
from odb.plan.rollout_plan import ROLLOUT_LAYOUTS, RolloutPlan, plan_rollout_steps

__all__ = ["STEP_PLANS", "RolloutMicroSteps", "enable_odb_rl", "is_rl_trainer", "resolve_step_plan"]

STEP_PLANS = ("auto", "global", "rank")

_RECENT = 1024  # micro-batch shapes kept for inspection (tests, debugging)


def resolve_step_plan(step_plan: str, trainer: Any, name: str, kind: str, world_size: int) -> str:
    """The plan ``step_plan`` asks for on ``world_size`` ranks: ``"global"`` or ``"rank"``. ``"auto"`` is
    ``"global"`` on several ranks when rows can move exactly (``rows_stay_home``), else ``"rank"``; an explicit
    ``"global"`` whose rows cannot move is refused.

    Example:
        >>> from types import SimpleNamespace
        >>> t = SimpleNamespace()
        >>> [resolve_step_plan("auto", t, "GRPOTrainer", k, w) for k, w in (("dapo", 2), ("dapo", 1), ("bnpo", 2))]
        ['global', 'rank', 'rank']
        >>> resolve_step_plan("global", t, "GRPOTrainer", "bnpo", 2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: odb got step_plan='global' for GRPOTrainer with loss_type='bnpo': ... Fix: step_plan='auto' ...
    """
    if step_plan not in STEP_PLANS:
        raise ValueError(f"odb got step_plan={step_plan!r} for {name}. Rule: one of {STEP_PLANS}. Fix: pass "
                         f"step_plan='auto' (default: rows move between ranks where the loss allows it), "
                         f"'global' or 'rank'.")
    why = rows_stay_home(trainer, kind)
    if step_plan == "global" and why:
        raise ValueError(f"odb got step_plan='global' for {name} with {why}. Rule: rows move between ranks only "
                         f"for losses whose normaliser does not depend on the rank a row came from (loss_type grpo, "
                         f"sapo, luspo, dr_grpo, dapo, cispo, vespo or RLOO, without the entropy bonus). Fix: "
                         f"step_plan='auto' or 'rank' (rows stay on their rank), or a loss_type such as 'dapo' "
                         f"and entropy_coef=0.0.")
    if step_plan == "auto":
        return "global" if world_size > 1 and not why else "rank"
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
    as the module docstring says; the plan taken is ``trainer.odb_rl.step_plan``. ``"global"`` with
    ``loss_type="bnpo"`` or the entropy bonus is refused.

    Settings whose loss odb cannot split exactly are refused (``ValueError`` naming the setting,
    the reason and the fix; ``odb.integrations.trl_rl_loss.check_rl_settings``).

    Example:
        >>> enable_odb_rl(object(), token_budget=4096)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: odb.integrations.trl_rl.enable_odb_rl got object, not a TRL GRPOTrainer or RLOOTrainer. ...
    """
    name, kind = check_rl_settings(trainer)
    if isinstance(token_budget, bool) or not isinstance(token_budget, (int, np.integer)) or token_budget < 1:
        raise ValueError(f"odb got token_budget={token_budget!r} for {name}. Rule: the padded tokens of one "
                         f"micro-batch, a positive integer. Fix: pass e.g. token_budget=8192.")
    longest = int(getattr(trainer, "max_completion_length", 0) or 0) + 1
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
    plan = resolve_step_plan(step_plan, trainer, name, kind, world()[1])
    if layout == "packed":
        from odb.packed.models import prepare_packed_model

        policy = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
        prepare_packed_model(policy, attention=packed_attention)  # refuses a model that mixes packed samples
    steps = RolloutMicroSteps(trainer, name, kind, int(token_budget), exchange_timeout_s, layout, plan)
    trainer.odb_rl = steps
    trainer.compute_loss = steps.compute_loss  # the Trainer's training_step calls it, then backward on its loss
    return trainer


@dataclasses.dataclass
class RolloutCounts:
    """What ``RolloutMicroSteps`` ran on this rank, since it was installed.

    Example:
        >>> counts = RolloutCounts()
        >>> counts.micro_steps, counts.moved_rows
        (0, 0)
    """

    slices: int = 0  # training slices (loss calls of the Trainer in training)
    micro_steps: int = 0
    padded_tokens: int = 0  # the tokens the model ran, padding included
    real_tokens: int = 0
    moved_rows: int = 0  # rows this rank received from other ranks (``step_plan="global"``)
    moved_bytes: int = 0  # their bytes


class RolloutMicroSteps:
    """The training slice's loss as micro-batches under ``token_budget`` (installed by ``enable_odb_rl``).

    ``compute_loss`` (the trainer's, in training; evaluation runs TRL's own) plans the slice's
    rows with every rank (``step_plan``: ``"global"``, rows move, or ``"rank"``), runs TRL's loss
    and a backward pass on every micro-batch but the last (under ``no_sync``), and returns the
    sum of their detached losses plus the last one's: the Trainer's own backward on it
    completes the step. ``recent``: (rows, prompt width, completion width, tokens run) of the
    last micro-batches, ``plans`` the last slices' plans, ``moves`` the last slices' (rows,
    bytes) this rank received from other ranks; ``counts`` (``RolloutCounts``) counts all of them.
    """

    def __init__(self, trainer: Any, name: str, kind: str, token_budget: int, exchange_timeout_s: float,
                 layout: str = "padded", step_plan: str = "rank") -> None:
        self.trainer, self.name, self.kind, self.step_plan = trainer, name, kind, step_plan
        self.token_budget, self.exchange_timeout_s = token_budget, float(exchange_timeout_s)
        self.pad_to_multiple_of = int(getattr(trainer, "pad_to_multiple_of", None) or 1)
        self.layout = layout
        pad_id = getattr(getattr(trainer, "processing_class", None), "pad_token_id", None)
        self.forward = RolloutForward(layout, self.pad_to_multiple_of, int(pad_id or 0))
        self.original = trainer.compute_loss
        self.exchange: Optional[RankExchange] = None
        self.recent: Deque[Tuple[int, int, int, int]] = collections.deque(maxlen=_RECENT)
        self.counts = RolloutCounts()
        self.plans: Deque[Union[RolloutPlan, GlobalRolloutPlan]] = collections.deque(maxlen=_RECENT)
        self.moves: Deque[Tuple[int, int]] = collections.deque(maxlen=_RECENT)

    def compute_loss(self, model: Any, inputs: Dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        trainer = self.trainer
        if return_outputs or not trainer.model.training:
            return self.original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        check_rollout_keys(inputs, self.name)
        rank, _ = world()
        plan = self.plan(inputs)
        pieces = self._pieces(inputs, plan, rank)
        # Factors against the rank's own slice, moved rows included (exact: odb.integrations.trl_rl_loss).
        normaliser = SliceNormaliser(self.kind, inputs)
        # The Trainer divides what it backpropagates by the accumulation steps unless the loss is already scaled
        # for them (GRPO scales it, RLOO does not): the passes odb backpropagates itself get the same division.
        divide = 1.0 if trainer.loss_is_scaled_for_ga else float(trainer.current_gradient_accumulation_steps)
        done, loss = [], None
        # Moved rows: each rank's micro-batch holds its own number of rows, which TRL's per-row gathers must take.
        with ragged_gather(trainer.accelerator) if self.step_plan == "global" else contextlib.nullcontext():
            for step in range(plan.steps):
                piece = pieces(step)
                last = step == plan.steps - 1
                ran = self.forward.tokens
                with contextlib.nullcontext() if last else trainer.accelerator.no_sync(model):
                    with self.forward.swapped_in(trainer):
                        loss = self._piece_loss(model, piece, normaliser, num_items_in_batch)
                    self._count(piece, self.forward.tokens - ran)
                    if not last:
                        trainer.accelerator.backward(loss / divide)
                        done.append(loss.detach())
                        loss = None
        self.counts.slices += 1
        self._log(plan, rank)
        return loss + sum(done) if done else loss

    def _pieces(self, inputs: Dict[str, Any], plan: Union[RolloutPlan, GlobalRolloutPlan], rank: int
                ) -> Callable[[int], Dict[str, Any]]:
        """The micro-batch of each micro-step of this rank (a global plan's moved rows exchanged first)."""
        if isinstance(plan, RolloutPlan):
            return lambda step: take_rows(inputs, plan.rows(rank, step), *(int(w) for w in plan.widths[rank, step]))
        where = f"{self.name} step {self.trainer.state.global_step} (odb's rollout rows)"
        received, rows, size = move_rows(self.exchange, inputs, plan, rank, where)
        self.moves.append((rows, size))
        self.counts.moved_rows += rows
        self.counts.moved_bytes += size
        return lambda step: micro_batch(inputs, received, rank, plan.n, plan.rows(rank, step),
                                        *(int(w) for w in plan.widths[rank, step]))

    def plan(self, inputs: Dict[str, Any]) -> Union[RolloutPlan, GlobalRolloutPlan]:
        """Every rank's micro-steps for this slice (one exchange of row lengths when there are several ranks):
        a ``GlobalRolloutPlan`` (``step_plan="global"``) or a ``RolloutPlan``."""
        prompt, completion = rollout_lengths(inputs)
        rank, size = world()
        if size > 1:
            if self.exchange is None:  # a gloo group of odb's: every rank reaches the first step's loss in order
                self.exchange = GroupExchanges()(self.exchange_timeout_s)
            where = f"{self.name} step {self.trainer.state.global_step} (odb's rollout micro-steps)"
            rows = self.exchange.all_gather(np.array([len(prompt)]), where)[:, 0]
            if (rows != rows[0]).any():
                raise ValueError(f"odb rank {rank}: the ranks' {self.name} training slices hold {rows.tolist()} "
                                 f"rollouts. Rule: every rank trains as many rows per step (TRL gathers per-row "
                                 f"metrics at each loss call). Fix: the same per_device_train_batch_size on every "
                                 f"rank, and a dataset that fills every generation batch.")
            both = self.exchange.all_gather(np.stack([prompt, completion]), where)
            prompt_all, completion_all = both[:, 0], both[:, 1]
        else:
            prompt_all, completion_all = prompt[None], completion[None]
        planner = plan_rollout_global if self.step_plan == "global" else plan_rollout_steps
        plan = planner(prompt_all, completion_all, self.token_budget, self.pad_to_multiple_of, layout=self.layout)
        self.plans.append(plan)
        return plan

    def _piece_loss(self, model: Any, piece: Dict[str, Any], normaliser: SliceNormaliser,
                    num_items_in_batch: Any) -> Any:
        """TRL's loss on ``piece`` as its share of the slice's: the policy term times its factor, the entropy
        bonus (when on) through a coefficient that gives it its own factor for this call."""
        trainer = self.trainer
        policy, entropy = normaliser.factors(piece)
        coef = float(getattr(trainer, "entropy_coef", 0.0) or 0.0)
        if not getattr(trainer, "_entropy_bonus_enabled", False) or coef == 0.0 or entropy == policy:
            return self.original(model, piece, num_items_in_batch=num_items_in_batch) * policy
        logged = trainer._metrics["train"].get("entropy_coef")
        before = len(logged) if logged is not None else 0
        trainer.entropy_coef = coef * entropy / policy
        try:
            loss = self.original(model, piece, num_items_in_batch=num_items_in_batch)
        finally:
            trainer.entropy_coef = coef
            logged = trainer._metrics["train"].get("entropy_coef")
            if logged is not None and len(logged) > before:  # TRL logs the coefficient: the user's, not odb's
                logged[-1] = coef
        return loss * policy

    def _count(self, piece: Dict[str, Any], tokens: int) -> None:
        rows, width_p, width_c = (int(piece["prompt_ids"].shape[0]), int(piece["prompt_ids"].shape[1]),
                                  int(piece["completion_ids"].shape[1]))
        self.recent.append((rows, width_p, width_c, int(tokens)))
        self.counts.micro_steps += 1
        self.counts.padded_tokens += int(tokens)
        self.counts.real_tokens += int(piece["prompt_mask"].sum().item()) + int(loss_mask(piece).sum().item())

    def _log(self, plan: Union[RolloutPlan, GlobalRolloutPlan], rank: int) -> None:
        metrics = getattr(self.trainer, "_metrics", None)
        if isinstance(metrics, dict) and "train" in metrics:
            metrics["train"]["odb_micro_steps"].append(float(plan.steps))
            metrics["train"]["odb_micro_batch_tokens"].append(float(plan.costs[rank].mean()))
            if self.step_plan == "global":
                metrics["train"]["odb_moved_rows"].append(float(self.moves[-1][0]))


def is_rl_trainer(trainer: Any) -> bool:
    """Whether ``trainer`` is a TRL ``GRPOTrainer`` or ``RLOOTrainer`` (or a subclass of one).

    Example:
        >>> is_rl_trainer(object())
        False
    """
    return any(RL_MODULES.get(c.__name__) == c.__module__ for c in type(trainer).__mro__)
