"""odb in TRL's ``SFTTrainer``: the supervised tokens TRL's collator trains on, and padding-free rows.

``odb.integrations.hf.enable_odb(trainer, token_budget=...)`` works on an ``SFTTrainer``
(TRL 1.16, the ``trl`` extra's range) with TRL's own data preparation and collator; ``enable_odb`` here is the
same call, refusing trainers that are not TRL's. TRL is never imported by odb: what is
read comes from the objects the trainer already holds.

What TRL's ``DataCollatorForLanguageModeling`` implies, applied when odb is enabled:

- the supervised tokens of a sample are counted as the collator labels it and the
  model's loss counts it (``SFTLossTokens``): labels are the sample's ``labels`` (TRL 1.x
  builds them while preparing the dataset, -100 outside ``completion_mask`` and
  ``assistant_masks``; older collators built them from those masks), minus the first token
  (the causal shift in padded rows; the masked first position of each sample in a
  padding-free row), so odb's default count would exceed the model's by one token per sample;
- TRL >= 1.15 computes the loss itself (a fused LM head, no logits): odb does not ask for
  ``return_outputs`` (an extra forward there) and divides out its cross-rank factor, which
  it applies whenever ``average_tokens_across_devices`` (``sft_computes_loss``);
- ``padding_free=True`` (one padding-free row per batch) is odb's ``layout="packed"``:
  a batch costs the sum of its samples' lengths and is planned to fill the budget. A
  model with ``sdpa``/``eager`` attention (exact on packed rows only through a dense
  mask of the whole row, slower than padded batches) is switched to ``"odb_varlen"``
  and the log says so once (``packed_attention="model"`` keeps it); the model is then
  probed once (``odb.check_packed_model``) and refused if a packed sample sees the others;
- ``pad_to_multiple_of`` becomes odb's, so a padded batch stays within the budget.

- TRL's vision-language collator (a processor and image samples): each sample is read
  processed alone by that collator and odb pads them (``odb.integrations.trl_vision``).

Refused, with the reason and the fix: ``packing=True`` (rows of ``max_length`` built
before odb sees them) and odb options that contradict the collator.

TRL's ``GRPOTrainer`` and ``RLOOTrainer`` keep their sampler and generation: odb cuts their
policy update into token-budget micro-batches, padded or packed, rows moving between ranks
where the loss allows it (``odb.integrations.trl_rl``: ``token_budget``, ``layout``, ``step_plan``
and ``packed_attention`` only).

TRL's ``DPOTrainer`` and ``RewardTrainer`` train exactly too: a preference pair is one
sample budgeted as the two rows it collates to, and the loss is weighted per pair
(``odb.integrations.trl_pairs``). TRL's other trainers are refused with the reason and the fix.

Example:
    >>> from trl import SFTConfig, SFTTrainer                                    # doctest: +SKIP
    >>> from odb.integrations.trl import enable_odb                              # doctest: +SKIP
    >>> trainer = SFTTrainer(model=model, args=SFTConfig("out", padding_free=True, max_length=None),
    ...                      train_dataset=ds, processing_class=tokenizer)      # doctest: +SKIP
    >>> enable_odb(trainer, token_budget=16384).train()                          # doctest: +SKIP
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

from odb.config import ODBConfig
from odb.integrations.trl_pairs import PairLength, PairUnits, pair_options, pair_trainer  # noqa: F401
from odb.integrations.trl_rl import enable_odb_rl, is_rl_trainer  # noqa: F401
from odb.integrations.trl_rules import (_SFT_MODULE, IGNORE_INDEX, SFTLossTokens, check_trl_trainer,  # noqa: F401
                                        sft_options)

__all__ = ["PairLength", "PairUnits", "SFTLossTokens", "enable_odb", "enable_odb_rl", "pair_options",
           "sft_options"]


def enable_odb(trainer: Any, token_budget: Any = None, *, config: Optional[ODBConfig] = None,
               lengths: Optional[Sequence[int]] = None, packed_attention: str = "odb_varlen",
               **odb_options: Any) -> Any:
    """Switch a TRL ``SFTTrainer``, ``DPOTrainer`` or ``RewardTrainer`` to odb batches, in place; returns it.

    The same as ``odb.integrations.hf.enable_odb`` (which applies TRL's rules too), but
    refuses a trainer that is not one of those. A ``GRPOTrainer`` or ``RLOOTrainer`` goes to
    ``odb.integrations.trl_rl.enable_odb_rl`` (``token_budget``, ``layout``, ``step_plan``, ``packed_attention``): its
    policy update is cut by tokens.

    Example:
        >>> enable_odb(object(), token_budget=4096)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: odb.integrations.trl.enable_odb got object, not a trl.SFTTrainer, DPOTrainer, RewardTrainer, ...
    """
    if is_rl_trainer(trainer):  # GRPO, RLOO: odb cuts the policy update; TRL keeps its sampler (trl_rl)
        extra = sorted(set(odb_options) - {"layout", "step_plan"})
        extra += [k for k, v in (("config", config), ("lengths", lengths)) if v is not None]
        if extra:
            raise TypeError(f"odb.integrations.trl.enable_odb got {extra} for {type(trainer).__name__}, which takes "
                            f"token_budget, layout, step_plan and packed_attention only: odb cuts its policy "
                            f"update, not its loader. Fix: pass those alone (odb.integrations.trl_rl.enable_odb_rl).")
        return enable_odb_rl(trainer, token_budget, layout=odb_options.get("layout", "padded"),
                             step_plan=odb_options.get("step_plan", "auto"), packed_attention=packed_attention)
    check_trl_trainer(trainer)  # TRL's other trainers, each with its reason
    sft = sys.modules.get(_SFT_MODULE)
    if (sft is None or not isinstance(trainer, sft.SFTTrainer)) and pair_trainer(trainer) is None:
        raise TypeError(f"odb.integrations.trl.enable_odb got {type(trainer).__name__}, not a trl.SFTTrainer, "
                        f"DPOTrainer, RewardTrainer, GRPOTrainer or RLOOTrainer (the TRL trainers odb trains). Fix: "
                        f"pass one of those trainer instances, or use odb.integrations.hf.enable_odb for other "
                        f"Trainers.")
    from odb.integrations.hf.trainer import enable_odb as enable

    return enable(trainer, token_budget, config=config, lengths=lengths, packed_attention=packed_attention,
                  **odb_options)
