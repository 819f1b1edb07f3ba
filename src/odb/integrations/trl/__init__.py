"""odb in TRL's ``SFTTrainer``: the supervised tokens TRL's collator trains on, and padding-free rows.

``odb.enable_odb(trainer, token_budget=...)`` works on an ``SFTTrainer`` (TRL 1.16, the ``trl`` extra's range)
with TRL's own data preparation and collator; ``enable_odb`` here (and ``odb.integrations.hf.enable_odb``) is the
same call, which takes every trainer odb trains and dispatches by its type (``odb.integrations.enable``). TRL is
never imported by odb: what is read comes from the objects the trainer already holds.

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
  processed alone by that collator and odb pads them (``odb.integrations.trl.vision``).

Refused, with the reason and the fix: ``packing=True`` (rows of ``max_length`` built
before odb sees them) and odb options that contradict the collator.

TRL's ``GRPOTrainer`` and ``RLOOTrainer`` keep their sampler and generation: odb cuts their
policy update into token-budget micro-batches, padded or packed, rows moving between ranks
for every loss, with vLLM's rollouts too (``odb.integrations.trl.rl``: ``token_budget``, ``layout``,
``step_plan`` and ``packed_attention`` only).

TRL's ``DPOTrainer`` and ``RewardTrainer`` train exactly too: a preference pair is one
sample budgeted as the two rows it collates to, and the loss is weighted per pair
(``odb.integrations.trl.pairs``). TRL's other trainers are refused with the reason and the fix.

Example:
    >>> from trl import SFTConfig, SFTTrainer                                    # doctest: +SKIP
    >>> from odb.integrations.trl import enable_odb                              # doctest: +SKIP
    >>> trainer = SFTTrainer(model=model, args=SFTConfig("out", padding_free=True, max_length=None),
    ...                      train_dataset=ds, processing_class=tokenizer)      # doctest: +SKIP
    >>> enable_odb(trainer, token_budget=16384).train()                          # doctest: +SKIP
"""

from __future__ import annotations

from odb.integrations.enable import enable_odb  # noqa: F401  (odb.enable_odb: every trainer, by its type)
from odb.integrations.trl.pairs import PairLength, PairUnits, pair_options, pair_trainer  # noqa: F401
from odb.integrations.trl.rl import enable_odb_rl, is_rl_trainer  # noqa: F401
from odb.integrations.trl.rules import (_SFT_MODULE, IGNORE_INDEX, SFTLossTokens, check_trl_trainer,  # noqa: F401
                                        sft_options)

__all__ = ["PairLength", "PairUnits", "SFTLossTokens", "enable_odb", "enable_odb_rl", "pair_options",
           "sft_options"]
