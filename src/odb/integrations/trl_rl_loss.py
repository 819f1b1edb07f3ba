"""How TRL's GRPO and RLOO losses of a training slice split into micro-batches exactly, and what is refused.

Every loss term of ``GRPOTrainer._compute_loss`` and ``RLOOTrainer._compute_loss`` is a sum
over rows of values that depend on that row alone (its advantages, its importance ratios
per token or per sequence, its KL to the reference, its off-policy mask), divided by a
normaliser. So TRL's loss on a micro-batch of the slice, times ``normaliser of the
micro-batch / normaliser of the slice``, is that micro-batch's share of TRL's loss on the
slice, and the shares add up to it:

=========================  ===========================================  ======================
loss_type                  TRL's normaliser                             factor of a micro-batch
=========================  ===========================================  ======================
grpo, sapo, luspo, RLOO    the slice's rows (a mean of row values)      rows_m / rows
dr_grpo                    rows x max_completion_length                 rows_m / rows
bnpo                       the slice's loss tokens                      tokens_m / tokens
dapo, cispo, vespo         the generation batch's loss tokens (global)  1
entropy bonus              the slice's loss tokens                      tokens_m / tokens
=========================  ===========================================  ======================

(counts clamped at 1, as TRL clamps them). The entropy bonus has its own normaliser: for
that call, odb sets the trainer's ``entropy_coef`` to ``coef x entropy factor / policy
factor`` and multiplies the loss by the policy factor, so each term gets its own factor.

Settings whose loss is not such a sum, or that odb has not been shown to train exactly, are
refused at enable time (``check_rl_settings``).

Rows moved between ranks (``step_plan="global"``, ``odb.plan.rollout_global``): a rank's
micro-batch may hold rows of other ranks' slices, each factor still taken against the rank's
own slice. That is exact where the normaliser does not depend on the rank a row came from
(``rows_stay_home`` says when it does): "rows" kinds divide by n, the rows of a slice, the
same on every rank (odb checks it each step), and "global" ones by a constant of the whole
generation batch. Under DDP the gradient is the mean over the W ranks of the gradient of each
rank's loss. TRL's: (1/W) sum_r grad (1/N_r) sum_{i in slice r} l_i, with N_r = n (rows) or
N / W (global: N the generation batch's loss tokens, W x TRL's ``num_items_in_batch /
num_processes``). odb's: rank r trains micro-batches m, each TRL's loss (1/N_m) sum_{i in m} l_i
times the factor N_m / N_r, so rank r's loss is (1/n) sum_{i in r's micro-batches} l_i (rows) or
(W/N) sum_{i in them} l_i (global); every row is in one micro-batch of one rank, so the sum over
ranks is (1/n) sum_i l_i (or (W/N) sum_i l_i) over all rows in both cases, and so is the mean
over ranks of the gradients. "tokens" (bnpo) and the entropy bonus divide by the loss tokens of
the row's own slice, which differ between ranks: moved rows would need per-row weights, so
their rows stay on their rank.

Example:
    >>> import torch
    >>> slice_ = {"completion_mask": torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])}
    >>> norm = SliceNormaliser("bnpo", slice_)
    >>> norm.factors({"completion_mask": torch.tensor([[1, 1, 0]])})
    (0.3333333333333333, 0.3333333333333333)
    >>> SliceNormaliser("grpo", slice_).factors({"completion_mask": torch.tensor([[1, 1, 0]])})
    (0.3333333333333333, 0.3333333333333333)
"""

from __future__ import annotations

from typing import Any, Mapping, Tuple

import torch

__all__ = ["LOSS_FACTORS", "RL_MODULES", "SliceNormaliser", "check_rl_settings", "loss_mask", "rows_stay_home"]

# What TRL divides each loss_type's policy term by: the slice's "rows", its "tokens", or a "global" constant.
LOSS_FACTORS = {"grpo": "rows", "sapo": "rows", "luspo": "rows", "dr_grpo": "rows", "rloo": "rows",
                "bnpo": "tokens", "dapo": "global", "cispo": "global", "vespo": "global"}
RL_MODULES = {"GRPOTrainer": "trl.trainer.grpo_trainer", "RLOOTrainer": "trl.trainer.rloo_trainer"}
_UNSUPPORTED_BACKENDS = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")


def loss_mask(inputs: Mapping[str, Any]) -> torch.Tensor:
    """The tokens TRL's loss counts: ``completion_mask``, times ``tool_mask`` when the rollouts have one."""
    mask = inputs["completion_mask"]
    tool = inputs.get("tool_mask")
    return mask if tool is None else mask * tool


class SliceNormaliser:
    """The factors that make TRL's loss on a micro-batch that micro-batch's share of its loss on ``whole``.

    ``kind``: a GRPO ``loss_type`` or ``"rloo"``. ``factors(piece)`` returns (policy factor, entropy factor).
    """

    def __init__(self, kind: str, whole: Mapping[str, Any]) -> None:
        self.kind = LOSS_FACTORS[kind]
        self.rows = int(whole["completion_mask"].shape[0])
        self.tokens = max(float(loss_mask(whole).sum().item()), 1.0)

    def factors(self, piece: Mapping[str, Any]) -> Tuple[float, float]:
        rows = int(piece["completion_mask"].shape[0])
        tokens = max(float(loss_mask(piece).sum().item()), 1.0)
        entropy = tokens / self.tokens
        if self.kind == "rows":
            return rows / self.rows, entropy
        if self.kind == "tokens":
            return entropy, entropy
        return 1.0, entropy


def rows_stay_home(trainer: Any, kind: str) -> str:
    """Why rows of this trainer's slices cannot move between ranks exactly ("" when they can): a loss_type whose
    normaliser is the loss tokens of the row's own slice, or the entropy bonus (the same normaliser).

    Example:
        >>> from types import SimpleNamespace
        >>> rows_stay_home(SimpleNamespace(), "dapo"), rows_stay_home(SimpleNamespace(), "bnpo")[:16]
        ('', "loss_type='bnpo'")
        >>> rows_stay_home(SimpleNamespace(_entropy_bonus_enabled=True, entropy_coef=0.5), "grpo")[:16]
        'entropy_coef=0.5'
    """
    if LOSS_FACTORS.get(kind) == "tokens":
        return f"loss_type={kind!r}: it divides by the loss tokens of each rank's own slice"
    coef = float(getattr(trainer, "entropy_coef", 0.0) or 0.0)
    if getattr(trainer, "_entropy_bonus_enabled", False) and coef != 0.0:
        return f"entropy_coef={coef}: the entropy bonus divides by the loss tokens of each rank's own slice"
    return ""


def trainer_kind(trainer: Any) -> Tuple[str, str]:
    """(TRL trainer name, loss kind: its ``loss_type`` or ``"rloo"``) of a GRPOTrainer or RLOOTrainer."""
    trl_class = next((c for c in type(trainer).__mro__ if RL_MODULES.get(c.__name__) == c.__module__), None)
    if trl_class is None:
        raise TypeError(f"odb.integrations.trl_rl.enable_odb_rl got {type(trainer).__name__}, not a TRL "
                        f"GRPOTrainer or RLOOTrainer. Fix: pass that trainer instance; for SFTTrainer, DPOTrainer "
                        f"and RewardTrainer use odb.integrations.trl.enable_odb.")
    name = trl_class.__name__
    return name, ("rloo" if name == "RLOOTrainer" else str(getattr(trainer, "loss_type", None)))


def _refuse(name: str, setting: str, why: str, fix: str) -> None:
    raise ValueError(f"odb cannot cut {name}'s policy update exactly with {setting}: {why}. Fix: {fix}.")


def check_rl_settings(trainer: Any) -> Tuple[str, str]:
    """Refuse the settings whose loss odb cannot split into micro-batches exactly (or has not been shown to);
    returns ``trainer_kind(trainer)``.

    Example:
        >>> check_rl_settings(object())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: odb.integrations.trl_rl.enable_odb_rl got object, not a TRL GRPOTrainer or RLOOTrainer. ...
    """
    name, kind = trainer_kind(trainer)
    args = trainer.args
    if kind not in LOSS_FACTORS:
        _refuse(name, f"loss_type={kind!r}", f"odb knows how TRL normalises {sorted(set(LOSS_FACTORS) - {'rloo'})}",
                "pick one of those loss types, or train without odb")
    for method in ("compute_loss", "_compute_loss"):
        owner = next(c for c in type(trainer).__mro__ if method in c.__dict__)
        if owner.__module__.split(".")[0] != "trl":
            _refuse(name, f"{method} overridden by {owner.__qualname__}",
                    f"odb's factors follow TRL's own {method}, and a loss of yours may not be a sum over rows",
                    f"keep TRL's {method} (override the rewards or the data instead), or train without odb")
    if getattr(trainer, "_is_vlm", False):
        _refuse(name, f"a vision-language model (processing_class {type(trainer.processing_class).__name__})",
                "its rollouts hold images that are not one per row, which odb does not cut into micro-batches",
                "train this vision-language model without odb's micro-batches")
    if getattr(trainer, "use_vllm", False):
        _refuse(name, "use_vllm=True", "vLLM's importance-sampling correction has not been shown exact under odb's "
                "micro-batches (no test covers it)", "use_vllm=False, or train without odb")
    if float(getattr(trainer, "top_entropy_quantile", 1.0)) < 1.0:
        _refuse(name, f"top_entropy_quantile={trainer.top_entropy_quantile}", "TRL masks the tokens below a quantile "
                "of the entropies of the micro-batch it is given, so a smaller micro-batch masks other tokens than "
                "the slice would", "top_entropy_quantile=1.0, or train without odb")
    if getattr(trainer, "use_adaptive_entropy", False):
        _refuse(name, "use_adaptive_entropy=True", "TRL updates the entropy coefficient at every loss call of the "
                "optimizer step's last slice, so more calls per slice would update it more than once",
                "a fixed entropy_coef (use_adaptive_entropy=False), or train without odb")
    if getattr(trainer, "aux_loss_enabled", False):
        _refuse(name, f"router_aux_loss_coef={getattr(args, 'router_aux_loss_coef', None)} on a mixture-of-experts "
                "model", "the router's load-balancing loss is a mean over the tokens of each call, not a sum over "
                "rows", "router_aux_loss_coef=0.0, or train without odb")
    if int(getattr(args, "n_gpu", 1) or 1) > 1:
        _refuse(name, f"n_gpu={args.n_gpu} (torch DataParallel)", "each micro-batch would be split again over the "
                "GPUs of one process", "one GPU per process (torchrun), or train without odb")
    backend = str(getattr(getattr(trainer, "accelerator", None), "distributed_type", "NO")).split(".")[-1]
    if backend in _UNSUPPORTED_BACKENDS:
        _refuse(name, f"distributed_type={backend}", "odb runs several backward passes per training step and "
                "has only been shown exact with DDP or one process (DeepSpeed counts its own micro-steps)",
                "train with DDP (plain torchrun / accelerate multi-GPU), or without odb")
    return name, kind
