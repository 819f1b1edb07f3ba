"""odb for the transformers Trainer (and Seq2SeqTrainer, TRL's SFTTrainer): ``enable_odb(trainer)``.

``enable_odb`` here is ``odb.enable_odb`` (``odb.integrations.enable``): it takes every trainer odb trains, TRL's
GRPO and RLOO and LLaMA-Factory's included, and dispatches by the trainer's type.

Example:
    >>> from odb.integrations.hf import enable_odb   # doctest: +SKIP
    >>> enable_odb(trainer, token_budget=16384)      # doctest: +SKIP
"""

from odb.integrations.enable import enable_odb
from odb.integrations.hf.trainer import ODBTrainer, ODBTrainerMixin, collator_options, configure_trainer

__all__ = ["ODBTrainer", "ODBTrainerMixin", "collator_options", "configure_trainer", "enable_odb"]
