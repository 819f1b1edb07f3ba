"""How TRL's GRPO and RLOO losses of a training step split into micro-batches exactly, rows of any rank in any
micro-batch, and what is refused.

Every loss term of ``GRPOTrainer._compute_loss`` and ``RLOOTrainer._compute_loss`` is a sum over
rows of values that depend on that row alone (its advantages, its importance ratios per token or
per sequence, vLLM's sampling correction, its KL to the reference, its off-policy mask), divided by
a normaliser of the slice the row came from (its *origin*: a rank's slice):

=========================  ===========================================  =================================
loss_type                  TRL's normaliser (of the origin's slice)     weight of a row in micro-batch m
=========================  ===========================================  =================================
grpo, sapo, luspo, RLOO    its rows n (a mean of row values)            rows_m / n
dr_grpo                    n x max_completion_length                    rows_m / n
bnpo                       its loss tokens T_o                          tokens_m / T_o
dapo, cispo, vespo         the generation batch's loss tokens (global)  1
entropy bonus              its loss tokens T_o                          tokens_m / T_o
=========================  ===========================================  =================================

(counts clamped at 1, as TRL clamps them). TRL's loss on micro-batch m divides by m's own count
(rows_m, tokens_m) or the global one; multiplying row i's gradient by its weight makes it row i's
share of its origin's loss. ``RowWeights`` gives each row of a micro-batch its weights, from every
rank's rows and loss tokens (which every rank holds: odb gathers them to plan). odb's forward
(``odb.integrations.trl.rl_forward``) applies them where TRL reads the model: it returns the same
log-probabilities and entropies, whose gradient through row i is scaled by the row's policy and
entropy weight (``x.detach() + w * (x - x.detach())``). So TRL's own loss runs once per micro-batch,
its values and metrics untouched, and its gradient is the micro-batch's share of the step's.

Its value is made the share's too (``share_value``): where the weights are equal over the
micro-batch, the weight times TRL's loss; the entropy bonus, whose weight may differ, is split off
per row by a first-order probe (the entropies times ``1 + q_i``, ``q = 0``: the loss's derivative in
``q_i`` is row i's bonus); under ``bnpo`` with rows of several origins, TRL's loss is linear in the
weights of its mask over their sum (T_m), so scaling each row's mask by ``1 + s_i`` gives row i's
whole term as ``dL/ds_i + L x tokens_i / T_m``. Under DDP the gradient is the mean over the W
ranks of the gradient of each rank's loss: TRL's is (1/W) sum_r grad loss_r(own slice); odb's
rank q trains some rows of any origin, each with its share of its origin's loss, and every row is
in one micro-batch of one rank, so the sum over ranks of odb's losses is the sum of TRL's, and so
are the gradients and the logged loss.

Settings whose loss is not such a sum, or that odb has not been shown to train exactly, are
refused at enable time (``check_rl_settings``).

Example:
    >>> import numpy as np
    >>> tokens = np.array([[3, 1, 0, 2], [5, 5, 5, 5]])   # rows' loss tokens on 2 ranks, 4 rows each
    >>> w = RowWeights("bnpo", tokens)
    >>> [x.tolist() for x in w.of(np.array([0, 4]))]       # rank 0's row 0 and rank 1's row 0: 8 tokens
    [[1.3333333333333333, 0.4], [1.3333333333333333, 0.4]]
    >>> [x.tolist() for x in RowWeights("grpo", tokens).of(np.array([0, 4]))]
    [[0.5, 0.5], [1.3333333333333333, 0.4]]
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import torch

from odb.private_api import check_classes, check_instance, owners_in
from odb.integrations.trl.rl_rows import IS_MODES

__all__ = ["LOSS_FACTORS", "RL_MODULES", "RowWeights", "check_rl_settings", "share_value", "trainer_kind"]

# What TRL divides each loss_type's policy term by: the slice's "rows", its "tokens", or a "global" constant.
LOSS_FACTORS = {"grpo": "rows", "sapo": "rows", "luspo": "rows", "dr_grpo": "rows", "rloo": "rows",
                "bnpo": "tokens", "dapo": "global", "cispo": "global", "vespo": "global"}
RL_MODULES = {"GRPOTrainer": "trl.trainer.grpo_trainer", "RLOOTrainer": "trl.trainer.rloo_trainer"}
_UNSUPPORTED_BACKENDS = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")
_LEVELS = ("token", "sequence")


class RowWeights:
    """The weights of a micro-batch's rows: (policy, entropy) arrays for flat rows ``origin * n + row``.

    ``kind``: a GRPO ``loss_type`` or ``"rloo"``; ``loss_tokens``: (world, n) every rank's rows' loss tokens.
    """

    def __init__(self, kind: str, loss_tokens: np.ndarray) -> None:
        self.kind = LOSS_FACTORS[kind]
        self.tokens = np.asarray(loss_tokens, dtype=np.float64)
        self.n = int(self.tokens.shape[1])
        self.origin_tokens = np.maximum(self.tokens.sum(axis=1), 1.0)  # T_o, clamped as TRL clamps

    def of(self, rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        rows = np.asarray(rows, dtype=np.int64)
        flat = self.tokens.reshape(-1)
        entropy = max(float(flat[rows].sum()), 1.0) / self.origin_tokens[rows // max(self.n, 1)]
        if self.kind == "rows":
            return np.full(len(rows), len(rows) / max(self.n, 1)), entropy
        if self.kind == "tokens":
            return entropy, entropy
        return np.ones(len(rows)), entropy


def trainer_kind(trainer: Any) -> Tuple[str, str]:
    """(TRL trainer name, loss kind: its ``loss_type`` or ``"rloo"``) of a GRPOTrainer or RLOOTrainer."""
    owners = owners_in(type(trainer), RL_MODULES)
    if not owners:
        raise TypeError(f"odb.integrations.trl.rl.enable_odb_rl got {type(trainer).__name__}, not a TRL "
                        f"GRPOTrainer or RLOOTrainer. Fix: pass that trainer instance; for SFTTrainer, DPOTrainer "
                        f"and RewardTrainer use odb.integrations.trl.enable_odb.")
    name = owners[0]
    return name, ("rloo" if name == "RLOOTrainer" else str(trainer.loss_type))


def _refuse(name: str, setting: str, why: str, fix: str) -> None:
    raise ValueError(f"odb cannot cut {name}'s policy update exactly with {setting}: {why}. Fix: {fix}.")


def check_rl_settings(trainer: Any) -> Tuple[str, str]:
    """Check TRL's names odb relies on (``odb.private_api``), then refuse the settings whose loss odb
    cannot split into micro-batches exactly (or has not been shown to); returns ``trainer_kind(trainer)``.

    Example:
        >>> check_rl_settings(object())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: odb.integrations.trl.rl.enable_odb_rl got object, not a TRL GRPOTrainer or RLOOTrainer. ...
    """
    owners = owners_in(type(trainer), RL_MODULES)
    if not owners:
        trainer_kind(trainer)  # raises, naming the type
    name = owners[0]
    trl_class = next(c for c in type(trainer).__mro__ if c.__name__ == name)
    check_classes(name, trl_class)
    check_instance(trainer, name)
    name, kind = trainer_kind(trainer)
    args = trainer.args
    if kind not in LOSS_FACTORS:
        _refuse(name, f"loss_type={kind!r}", f"odb knows how TRL normalises {sorted(set(LOSS_FACTORS) - {'rloo'})}",
                "pick one of those loss types, or train without odb")
    for method in ("compute_loss", "_compute_loss"):
        owner = next(c for c in type(trainer).__mro__ if method in c.__dict__)
        if owner.__module__.split(".")[0] != "trl":
            _refuse(name, f"{method} overridden by {owner.__qualname__}",
                    f"odb's weights follow TRL's own {method}, and a loss of yours may not be a sum over rows",
                    f"keep TRL's {method} (override the rewards or the data instead), or train without odb")
    if trainer._is_vlm:
        _refuse(name, f"a vision-language model (processing_class {type(trainer.processing_class).__name__})",
                "its rollouts hold images that are not one per row, which odb does not cut into micro-batches",
                "train this vision-language model without odb's micro-batches")
    if name == "GRPOTrainer":
        _check_grpo(trainer, name)
    if trainer.aux_loss_enabled:
        _refuse(name, f"router_aux_loss_coef={args.router_aux_loss_coef} on a mixture-of-experts model", "the "
                "router's load-balancing loss is a mean over the tokens of each call, not a sum over rows",
                "router_aux_loss_coef=0.0, or train without odb")
    if int(args.n_gpu) > 1:
        _refuse(name, f"n_gpu={args.n_gpu} (torch DataParallel)", "each micro-batch would be split again over the "
                "GPUs of one process", "one GPU per process (torchrun), or train without odb")
    backend = str(trainer.accelerator.distributed_type).split(".")[-1]
    if backend in _UNSUPPORTED_BACKENDS:
        _refuse(name, f"distributed_type={backend}", "odb runs several backward passes per training step and "
                "has only been shown exact with DDP or one process (DeepSpeed counts its own micro-steps)",
                "train with DDP (plain torchrun / accelerate multi-GPU), or without odb")
    return name, kind


def _check_grpo(trainer: Any, name: str) -> None:
    """GRPOTrainer's own settings: the entropy controls, the importance-sampling level and vLLM's correction."""
    if float(trainer.top_entropy_quantile) < 1.0:
        _refuse(name, f"top_entropy_quantile={trainer.top_entropy_quantile}", "TRL masks the tokens below a "
                "quantile of the entropies of the micro-batch it is given, so a smaller micro-batch masks other "
                "tokens than the slice would", "top_entropy_quantile=1.0, or train without odb")
    if trainer.use_adaptive_entropy:
        _refuse(name, "use_adaptive_entropy=True", "TRL updates the entropy coefficient at every loss call of the "
                "optimizer step's last slice, so more calls per slice would update it more than once",
                "a fixed entropy_coef (use_adaptive_entropy=False), or train without odb")
    if trainer.importance_sampling_level not in _LEVELS:
        _refuse(name, f"importance_sampling_level={trainer.importance_sampling_level!r}", f"odb knows TRL's "
                f"levels {_LEVELS}", "one of those, or train without odb")
    if not (trainer.use_vllm and trainer.vllm_importance_sampling_correction):
        return
    mode = trainer.vllm_importance_sampling_mode
    if mode not in IS_MODES:
        _refuse(name, f"vllm_importance_sampling_mode={mode!r}", f"odb knows TRL's modes {sorted(IS_MODES)}",
                "one of those, or train without odb")
    low, high = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
    keeps_one = (low is None or low <= 1.0) and (high is None or high >= 1.0)
    if trainer.loss_type == "vespo" and not keeps_one:
        _refuse(name, f"loss_type='vespo' with vllm_importance_sampling_clip_min={low} and clip_max={high}",
                "VESPO sums the log of the corrected ratio over every completion column, padding included, and "
                "these bounds move a padded column's ratio off 1, so its loss depends on how wide the slice is "
                "padded (odb's micro-batches are padded less)", "bounds that keep 1 inside [clip_min, clip_max], "
                "or train without odb")


def share_value(loss: torch.Tensor, w_pol: np.ndarray, w_ent: np.ndarray, bonus_probe: Optional[torch.Tensor],
                mask_probe: Optional[torch.Tensor], tokens: np.ndarray) -> Tuple[float, float]:
    """(the value of a micro-batch's share of the step's loss, its policy part) from TRL's ``loss`` on it: the
    module docstring says how. ``bonus_probe``: the ``q`` that multiplies the entropies as ``1 + q`` (None without
    the entropy bonus); ``mask_probe``: the ``s`` that multiplies the mask as ``1 + s`` (None but under bnpo with
    unequal weights, where ``w_pol`` may differ; else it is one value); ``tokens``: the rows' loss tokens.

    Example (bnpo's mean over 2 + 2 tokens: rows' policy terms 0.5 and 1.0, bonus terms -0.25 and -0.75; weights
    1 and 3):
        >>> q, s = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
        >>> mask = 2 * (1 + s)
        >>> loss = (mask * torch.tensor([1.0, 2.0])).sum() / mask.sum() \\
        ...        - (mask * torch.tensor([0.5, 1.5]) * (1 + q)).sum() / mask.sum()
        >>> share_value(loss, np.array([1.0, 3.0]), np.array([1.0, 3.0]), q, s, np.array([2, 2]))
        (1.0, 3.5)
    """
    wanted = [p for p in (bonus_probe, mask_probe) if p is not None]
    grads = list(torch.autograd.grad(loss, wanted, retain_graph=True, allow_unused=True)) if wanted else []
    rows = len(w_pol)

    def numbers(grad: Optional[torch.Tensor]) -> np.ndarray:
        return np.zeros(rows) if grad is None else grad.detach().double().cpu().numpy()

    bonus = numbers(grads.pop(0)) if bonus_probe is not None else np.zeros(rows)
    value = float(loss.detach())
    if mask_probe is not None:
        total = float(np.sum(tokens))
        whole = numbers(grads.pop(0)) + value * np.asarray(tokens, dtype=np.float64) / total if total >= 1 \
            else np.zeros(rows)  # each row's whole term: dL/ds_i + L x tokens_i / T_m
        policy = float(np.sum(w_pol * (whole - bonus)))
    else:
        policy = float(w_pol[0]) * (value - float(bonus.sum())) if rows else 0.0
    return policy + float(np.sum(w_ent * bonus)), policy
