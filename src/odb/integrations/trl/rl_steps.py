"""The policy update of an RL trainer's training slice as micro-batches (installed by ``odb.integrations.trl.rl``).

Per training slice (one ``compute_loss`` call of the Trainer in training), ``RolloutMicroSteps``:

1. checks the slice's keys (``odb.integrations.trl.rl_rows.RolloutKeys``) and gathers every rank's rows'
   prompt and completion lengths, loss tokens and completion tokens, and each rank's completion width
   (one small all-gather through odb's exchange, ``RolloutTable``);
2. plans the micro-steps of every rank from them (``odb.plan.rollouts.across_ranks`` or ``rollout_plan``) and
   moves the rows other ranks train (``odb.integrations.trl.rl_move``);
3. runs TRL's own ``compute_loss`` on each micro-batch, odb's forward standing in for TRL's (checked to be
   called), each row's gradient weighted by its share of its origin's loss and the value made that share
   (``odb.integrations.trl.rl_loss``), and a backward pass on every micro-batch but the last (under
   ``no_sync``); it returns the sum of their detached losses plus the last one's, whose backward the
   Trainer runs;
4. recombines TRL's metrics of the slice to TRL's values (``odb.integrations.trl.rl_metrics``).

A micro-batch is at least two completion columns wide where the slice is (TRL counts a value one column
wide per row in its metrics, as a sequence-level value).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Callable, Deque, Dict, Optional, Tuple, Union

import numpy as np
import torch

from odb.comm.dist import world
from odb.comm.exchanges import choose_exchanges
from odb.comm.protocol import RankExchange
from odb.integrations.trl.pairs import ragged_gather
from odb.integrations.trl.rl_forward import RolloutForward
from odb.integrations.trl.rl_loss import LOSS_FACTORS, RowWeights, share_value
from odb.integrations.trl.rl_metrics import (COMPLETION_TOKENS, POLICY_BEFORE_ACCUMULATION, ROWS, TOKENS,
                                             SliceMetrics, combine_slice)
from odb.integrations.trl.rl_move import micro_batch, move_rows
from odb.integrations.trl.rl_rows import loss_mask, rollout_keys, rollout_lengths, row_tokens, take_rows
from odb.plan.rollouts.across_ranks import GlobalRolloutPlan, plan_rollout_global
from odb.plan.rollouts.per_rank import RolloutPlan, plan_rollout_steps

__all__ = ["RolloutCounts", "RolloutMicroSteps", "RolloutTable"]

_RECENT = 1024  # micro-batch shapes kept for inspection (tests, debugging)
MIN_COMPLETION_WIDTH = 2
Plan = Union[RolloutPlan, GlobalRolloutPlan]


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


@dataclasses.dataclass(frozen=True)
class RolloutTable:
    """Every rank's rows of one slice: (world, n) prompt and completion lengths, loss tokens and completion
    tokens, and (world,) each rank's completion width (its tensors')."""

    prompt: np.ndarray
    completion: np.ndarray
    loss_tokens: np.ndarray
    completion_tokens: np.ndarray
    widths: np.ndarray

    @property
    def n(self) -> int:
        return int(self.prompt.shape[1])


class RolloutMicroSteps:
    """The training slice's loss as micro-batches under ``token_budget`` (the module docstring says how).

    ``recent``: (rows, prompt width, completion width, tokens run) of the last micro-batches, ``plans`` the last
    slices' plans, ``moves`` the last slices' (rows, bytes) this rank received from other ranks; ``counts``
    (``RolloutCounts``) counts all of them.
    """

    def __init__(self, trainer: Any, name: str, kind: str, token_budget: int, exchange_timeout_s: float,
                 layout: str = "padded", step_plan: str = "rank") -> None:
        self.trainer, self.name, self.kind, self.step_plan = trainer, name, kind, step_plan
        self.token_budget, self.exchange_timeout_s = token_budget, float(exchange_timeout_s)
        self.keys = rollout_keys(trainer, name)
        self.metrics = SliceMetrics.of(trainer, name)
        pad_id = trainer.processing_class.pad_token_id
        self.forward = RolloutForward(layout, int(trainer.pad_to_multiple_of or 1), int(pad_id or 0), owner=name)
        self.original = trainer.compute_loss
        self.exchange: Optional[RankExchange] = None
        self.recent: Deque[Tuple[int, int, int, int]] = collections.deque(maxlen=_RECENT)
        self.counts = RolloutCounts()
        self.plans: Deque[Plan] = collections.deque(maxlen=_RECENT)
        self.moves: Deque[Tuple[int, int]] = collections.deque(maxlen=_RECENT)

    def compute_loss(self, model: Any, inputs: Dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        trainer = self.trainer
        if return_outputs or not trainer.model.training:
            return self.original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        self.keys.check(inputs, self.name)
        rank, _ = world()
        table = self.table(inputs)
        plan = self.plan(table)
        pieces = self._pieces(inputs, plan, rank, table.widths)
        weights = RowWeights(self.kind, table.loss_tokens)
        logged = trainer._metrics["train"]
        before = {key: len(values) for key, values in logged.items()}
        # The Trainer divides what it backpropagates by the accumulation steps unless the loss is already scaled
        # for them (GRPO scales it, RLOO does not): the passes odb backpropagates itself get the same division.
        divide = 1.0 if trainer.loss_is_scaled_for_ga else float(trainer.current_gradient_accumulation_steps)
        done, loss, policy = [], None, 0.0
        # Moved rows: each rank's micro-batch holds its own number of rows, which TRL's per-row gathers must take.
        with ragged_gather(trainer.accelerator) if self.step_plan == "global" else contextlib.nullcontext():
            for step in range(plan.steps):
                rows = self._flat_rows(plan, rank, step, table.n)
                piece = pieces(step)
                last = step == plan.steps - 1
                ran = self.forward.tokens
                with contextlib.nullcontext() if last else trainer.accelerator.no_sync(model):
                    with self.forward.swapped_in(trainer):
                        loss, part = self._piece_loss(model, piece, rows, weights, table, num_items_in_batch)
                    policy += part
                    self._count(piece, self.forward.tokens - ran)
                    if not last:
                        trainer.accelerator.backward(loss / divide)
                        done.append(loss.detach())
                        loss = None
        combine_slice(logged, before, self.metrics.rules, self._metric_counts(plan, table), plan.steps,
                      self._mean_over_ranks(policy) if self.metrics.bonus else None)
        self.counts.slices += 1
        self._log(plan, rank)
        return loss + sum(done) if done else loss

    def table(self, inputs: Dict[str, Any]) -> RolloutTable:
        """Every rank's ``RolloutTable`` of this slice (one exchange when there are several ranks)."""
        prompt, completion = rollout_lengths(inputs)
        tokens, completion_tokens = row_tokens(inputs)
        width = int(inputs["completion_ids"].shape[1])
        rank, size = world()
        if size == 1:
            return RolloutTable(prompt[None], completion[None], tokens[None], completion_tokens[None],
                                np.array([width]))
        if self.exchange is None:  # a gloo group of odb's: every rank reaches the first step's loss in order
            self.exchange = choose_exchanges()[0](self.exchange_timeout_s)  # the loader's own choice
        where = f"{self.name} step {self.trainer.state.global_step} (odb's rollout micro-steps)"
        head = self.exchange.all_gather(np.array([len(prompt), width]), where)
        if (head[:, 0] != head[0, 0]).any():
            raise ValueError(f"odb rank {rank}: the ranks' {self.name} training slices hold {head[:, 0].tolist()} "
                             f"rollouts. Rule: every rank trains as many rows per step (TRL gathers per-row "
                             f"metrics at each loss call). Fix: the same per_device_train_batch_size on every "
                             f"rank, and a dataset that fills every generation batch.")
        rows = self.exchange.all_gather(np.stack([prompt, completion, tokens, completion_tokens]), where)
        return RolloutTable(rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], head[:, 1])

    def plan(self, table: RolloutTable) -> Plan:
        """Every rank's micro-steps for this slice: a ``GlobalRolloutPlan`` (``step_plan="global"``) or a
        ``RolloutPlan``."""
        planner = plan_rollout_global if self.step_plan == "global" else plan_rollout_steps
        plan = planner(table.prompt, table.completion, self.token_budget, self.forward.pad_to_multiple_of,
                       layout=self.forward.layout)
        self.plans.append(plan)
        return plan

    @staticmethod
    def _flat_rows(plan: Plan, rank: int, step: int, n: int) -> np.ndarray:
        rows = np.asarray(plan.rows(rank, step), dtype=np.int64)
        return rows if isinstance(plan, GlobalRolloutPlan) else rows + rank * n

    def _width(self, plan: Plan, rank: int, step: int, widths: np.ndarray) -> Tuple[int, int]:
        """(prompt, completion) widths of a micro-batch as it runs: the plan's, completions at least two columns
        where the rank's slice is (a moved micro-batch pads to them)."""
        width_p, width_c = (int(w) for w in plan.widths[rank, step])
        width_c = max(width_c, MIN_COMPLETION_WIDTH)
        return width_p, width_c if isinstance(plan, GlobalRolloutPlan) else min(width_c, int(widths[rank]))

    def _pieces(self, inputs: Dict[str, Any], plan: Plan, rank: int, widths: np.ndarray
                ) -> Callable[[int], Dict[str, Any]]:
        """The micro-batch of each micro-step of this rank (a global plan's moved rows exchanged first)."""
        if isinstance(plan, RolloutPlan):
            return lambda step: take_rows(inputs, plan.rows(rank, step), *self._width(plan, rank, step, widths),
                                          self.keys)
        where = f"{self.name} step {self.trainer.state.global_step} (odb's rollout rows)"
        received, rows, size = move_rows(self.exchange, inputs, plan, rank, where, self.keys)
        self.moves.append((rows, size))
        self.counts.moved_rows += rows
        self.counts.moved_bytes += size
        return lambda step: micro_batch(inputs, received, rank, plan.n, plan.rows(rank, step),
                                        *self._width(plan, rank, step, widths), self.keys)

    def _piece_loss(self, model: Any, piece: Dict[str, Any], rows: np.ndarray, weights: RowWeights,
                    table: RolloutTable, num_items_in_batch: Any) -> Tuple[torch.Tensor, float]:
        """TRL's loss on ``piece`` with each row's gradient weighted by its share of its origin's loss and its value
        that share's; and the share's policy term in TRL's ``policy_loss`` units (0 without the entropy bonus)."""
        w_pol, w_ent = weights.of(rows)
        tokens = table.loss_tokens.reshape(-1)[rows].astype(np.float64)
        device = piece["completion_mask"].device
        bonus = torch.zeros(len(rows), dtype=torch.float64, device=device, requires_grad=True) \
            if self.metrics.bonus else None
        mask = None
        if LOSS_FACTORS[self.kind] == "tokens" and self.step_plan == "global":  # bnpo: rows of several origins
            # On every rank and micro-step alike, in float32: TRL's sums of x * mask keep the dtypes they have with
            # its integer mask (its counts are float32), so its collectives see the same shapes on every rank.
            mask = torch.zeros(len(rows), dtype=torch.float32, device=device, requires_grad=True)
            piece = dict(piece, completion_mask=piece["completion_mask"] * (1 + mask)[:, None])
        self.forward.weigh(w_pol, w_ent, bonus)
        calls = self.forward.calls
        loss = self.original(model, piece, num_items_in_batch=num_items_in_batch)
        self.forward.stand_in.expect_called(calls, f"{self.name}.compute_loss on a micro-batch")
        value, policy = share_value(loss, w_pol, w_ent, bonus, mask, tokens)
        if self.metrics.bonus and self.kind in POLICY_BEFORE_ACCUMULATION:  # TRL's policy_loss is logged before it
            policy *= float(self.trainer.current_gradient_accumulation_steps)
        return loss + (value - float(loss.detach())), policy

    def _metric_counts(self, plan: Plan, table: RolloutTable) -> Dict[str, np.ndarray]:
        """Per micro-step, over all ranks: loss tokens, completion tokens and rows (a micro-batch one completion
        column wide counts its rows for the token-weighted metrics, as TRL counts a (rows, 1) value)."""
        out = {TOKENS: np.zeros(plan.steps), COMPLETION_TOKENS: np.zeros(plan.steps), ROWS: np.zeros(plan.steps)}
        loss, completion = table.loss_tokens.reshape(-1), table.completion_tokens.reshape(-1)
        for rank in range(len(plan.widths)):
            for step in range(plan.steps):
                rows = self._flat_rows(plan, rank, step, table.n)
                one_column = self._width(plan, rank, step, table.widths)[1] == 1
                out[ROWS][step] += len(rows)
                out[TOKENS][step] += len(rows) if one_column else loss[rows].sum()
                out[COMPLETION_TOKENS][step] += len(rows) if one_column else completion[rows].sum()
        return out

    def _mean_over_ranks(self, value: float) -> float:
        """The mean over ranks of ``value`` (one exchange when there are several ranks)."""
        if self.exchange is None:
            return float(value)
        where = f"{self.name} step {self.trainer.state.global_step} (odb's policy_loss metric)"
        bits = self.exchange.all_gather(np.array([value], dtype=np.float64).view(np.int64), where)
        return float(np.ascontiguousarray(bits).view(np.float64).mean())

    def _count(self, piece: Dict[str, Any], tokens: int) -> None:
        rows, width_p, width_c = (int(piece["prompt_ids"].shape[0]), int(piece["prompt_ids"].shape[1]),
                                  int(piece["completion_ids"].shape[1]))
        self.recent.append((rows, width_p, width_c, int(tokens)))
        self.counts.micro_steps += 1
        self.counts.padded_tokens += int(tokens)
        self.counts.real_tokens += int(piece["prompt_mask"].sum().item()) + int(loss_mask(piece).ne(0).sum().item())

    def _log(self, plan: Plan, rank: int) -> None:
        metrics = self.trainer._metrics["train"]
        metrics["odb_micro_steps"].append(float(plan.steps))
        metrics["odb_micro_batch_tokens"].append(float(plan.costs[rank].mean()))
        if self.step_plan == "global":
            metrics["odb_moved_rows"].append(float(self.moves[-1][0]))
