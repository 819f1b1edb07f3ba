"""odb for the transformers Trainer (and Seq2SeqTrainer, TRL's SFTTrainer): ``enable_odb(trainer)``.

Example:
    >>> from odb.integrations.hf import enable_odb   # doctest: +SKIP
    >>> enable_odb(trainer, token_budget=16384)      # doctest: +SKIP
"""

from odb.integrations.hf.trainer import ODBTrainer, ODBTrainerMixin, collator_options, configure_trainer, enable_odb

__all__ = ["ODBTrainer", "ODBTrainerMixin", "collator_options", "configure_trainer", "enable_odb"]
