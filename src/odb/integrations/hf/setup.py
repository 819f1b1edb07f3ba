"""Setup pieces of the HF Trainer integration: odb's per-trainer state, the progress callback,
the checks of TrainingArguments and of the Trainer's loop API, and configure_trainer."""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import transformers
from transformers import Trainer, TrainerCallback, TrainingArguments

from odb.config import ODBConfig
from odb.loader.dataloader import ODBDataLoader
from odb.step_info import ODBStepInfo
from odb.integrations.hf.progress import SampleProgress, WindowMetrics
from odb.private_api import check_classes

# transformers 5.3.0-5.5.3 also hand gradient_accumulation_steps to the Accelerator, so every micro-batch's loss
# is divided by it twice (fixed in 5.5.4): the gradient would not be odb's exact token mean.
MIN_TRANSFORMERS = "5.5.4"


@dataclasses.dataclass
class StepInfos:
    """The ODBStepInfo of the optimizer step being trained: per micro-batch, in order, and the one in use."""

    by_batch: Dict[int, ODBStepInfo] = dataclasses.field(default_factory=dict)  # id(micro-batch) -> its info
    step: Tuple[ODBStepInfo, ...] = ()
    active: Optional[ODBStepInfo] = None


@dataclasses.dataclass
class EpochFlags:
    """Where the Trainer's epoch stands for odb: a resume pending, its first pull, and the end of the data."""

    resume: bool = False  # the next epoch continues from a loaded loader state
    # The checkpoint whose RNG states the resumed epoch restores once its iterator is built (see
    # ODBTrainerMixin.get_batch_samples); None when there is nothing to restore.
    rng_checkpoint: Optional[str] = None
    first_pull: bool = False  # the next get_batch_samples is the first of a resumed epoch
    empty_resume: bool = False  # ...and found nothing left (the state was saved after its last step)
    exhausted: bool = False


class ODBRun:
    """odb's state inside one Trainer (one attribute, so the Trainer's namespace stays clean)."""

    def __init__(self, cfg: ODBConfig, lengths: Optional[Sequence[int]], shift: bool) -> None:
        self.cfg, self.lengths, self.shift = cfg, lengths, shift
        self.loader: Optional[ODBDataLoader] = None
        self.progress = SampleProgress(None, 1)
        self.window = WindowMetrics()
        self.steps = StepInfos()
        self.epoch = EpochFlags()
        # The collator's supervised tokens exist only once it has run (masked LM, left padding): counted then.
        self.count_after_collate = False
        self.collator_name = ""
        self.pairs = False  # TRL's DPOTrainer or RewardTrainer: a loss averaged per pair (odb.integrations.trl.pairs)
        self.banner: Optional["BannerLines"] = None  # rewrites the Trainer's train-start banner (log_batching)
        self.auto: Any = None  # token_budget="auto": the loader's AutoControl, measured per micro-batch by training_step

    @property
    def schedules_by_samples(self) -> bool:
        """Whether progress (the learning-rate schedule, ``state.max_steps``) follows the samples seen: only with
        budget-filled steps (``global_batch_size=None``) bounded by ``num_train_epochs``, whose optimizer steps odb
        cannot count in advance. With the user's batch the Trainer's steps are counted exactly and its schedule,
        warmup and ``max_steps`` run unchanged."""
        return self.cfg.global_batch_size is None and bool(self.progress.target_epochs)


class ProgressCallback(TrainerCallback):
    """Sets ``state.epoch`` from the samples seen and, with budget-filled steps only (``ODBRun.schedules_by_samples``),
    ``state.max_steps`` (runs before the Trainer's own flow callback, which stops training once ``global_step``
    reaches ``max_steps``); with the user's batch ``max_steps`` is the Trainer's own."""

    def __init__(self, run: ODBRun) -> None:
        self.run = run

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run.banner is not None:  # the banner has been logged
            self.run.banner.finish()
            self.run.banner = None

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        progress = self.run.progress
        state.epoch = progress.epochs_done
        if self.run.schedules_by_samples:  # budget-filled steps: the step count is re-estimated as the data goes
            state.max_steps = state.global_step if progress.reached() else \
                state.global_step + progress.steps_left_estimate()

    def on_epoch_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        run = self.run
        if run.epoch.exhausted:
            run.progress.end_epoch()
            state.epoch = run.progress.epochs_done
        if run.epoch.empty_resume and not run.progress.reached():
            control.should_training_stop = False  # the Trainer stops after an epoch without batches
        run.epoch.empty_resume = False


def configure_trainer(args: TrainingArguments, **changes: Any) -> TrainingArguments:
    """A copy of ``args`` set up for odb training, with ``changes`` applied on top.

    ``per_device_train_batch_size`` stays: with odb's default it sets the samples of each
    optimizer step (``per_device_train_batch_size x gradient_accumulation_steps x world size``),
    which odb splits into micro-batches under the token budget. The copy has
    ``auto_find_batch_size=False`` (lower ``token_budget`` instead) and ``dataloader_in_order=True``
    (odb reads samples in sampler order). ``enable_odb`` refuses those settings rather than changing
    them. ``train_sampling_strategy`` stays: odb keeps the steps of ``group_by_length`` and
    ``batch_rebalance`` (odb.integrations.hf.sampling).

    Example:
        >>> args = configure_trainer(TrainingArguments("out", auto_find_batch_size=True),
        ...                          num_train_epochs=2)               # doctest: +SKIP
        >>> args.auto_find_batch_size, args.num_train_epochs          # doctest: +SKIP
        (False, 2)
    """
    fixed: Dict[str, Any] = {"auto_find_batch_size": False}
    if getattr(args, "dataloader_in_order", True) is False:
        fixed["dataloader_in_order"] = True
    fixed.update(changes)
    return dataclasses.replace(args, **fixed)


def loss_shifts_labels(trainer: Trainer) -> bool:
    """Whether the model's loss drops each row's first label (causal LM): its ``loss_type`` maps to transformers'
    causal-LM loss and it is no encoder-decoder (the Trainer's own rule, read from the model's public attributes:
    odb's step counts must follow the model's loss, and odb replaces the Trainer's counting)."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    model = trainer.model  # a PEFT wrapper forwards these attributes to the model it wraps
    causal = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
    return causal and not getattr(getattr(model, "config", None), "is_encoder_decoder", False)


def check_args(trainer: Trainer) -> None:
    args = trainer.args
    problems = []
    if getattr(args, "dataloader_in_order", True) is False:
        problems.append("dataloader_in_order=False lets workers hand over samples as they finish, so odb's batches "
                        "would depend on worker timing and a resumed run would skip or repeat samples (fix: True; "
                        "odb's reader thread already keeps the workers a window ahead)")
    if args.auto_find_batch_size:
        problems.append("auto_find_batch_size=True shrinks a batch size odb does not use (fix: False, and "
                        "lower token_budget on out-of-memory)")
    if args.n_gpu > 1:
        problems.append(f"this process drives n_gpu={args.n_gpu} GPUs through torch.nn.DataParallel, which splits "
                        f"odb's batches (fix: one process per GPU, e.g. torchrun --nproc_per_node={args.n_gpu})")
    sizes = {"tensor": trainer.get_tp_size(), "context": trainer.get_cp_size(), "sequence": trainer.get_sp_size()}
    problems += [mesh_refusal(kind, size) for kind, size in sizes.items() if size > 1]
    if problems:
        raise ValueError("odb cannot train with these TrainingArguments: " + "; ".join(problems) +
                         ". odb.integrations.hf.configure_trainer(args) returns a copy without the batch-size "
                         "settings.")


def mesh_refusal(kind: str, size: int) -> str:
    """Why the Trainer integration refuses tensor, context or sequence parallelism, and what works instead."""
    import accelerate

    return (f"{kind} parallelism of size {size}: the Trainer (transformers {transformers.__version__}) runs it through "
            f"Accelerate's ParallelismConfig, which accelerate {accelerate.__version__} builds only under FSDP2, "
            f"DeepSpeed or several GPUs (it raises 'ParallelismConfig is only compatible DistributedType.FSDP "
            f"(version 2) or DistributedType.Multi{{Device}} or DistributedType.DEEPSPEED' for CPU processes), so odb "
            f"cannot test its Trainer integration with it (the Trainer's per-process batch size, checkpoints and loss "
            f"count every process, not the data-parallel replicas) and refuses it rather than train unchecked (fix: "
            f"a loop of your own, or Accelerate with configure_accelerator, over odb.ODBDataLoader(..., "
            f"device_mesh=mesh), which gives every peer of a replica the same batches: docs/distributed.md, "
            f"'Meshes'; or data parallelism only: DDP, FSDP or DeepSpeed ZeRO)")


def check_loop_api() -> None:
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise RuntimeError(
            f"odb.integrations.hf needs transformers>={MIN_TRANSFORMERS}: transformers {transformers.__version__} "
            f"divides the loss by gradient_accumulation_steps twice (in its Trainer and in its Accelerator), so "
            f"the gradient would not be odb's exact token mean. Fix: install transformers>={MIN_TRANSFORMERS} "
            f"(the versions tested: docs/versions.md), or use odb.ODBDataLoader in your own training loop.")
    # The Trainer methods odb overrides or calls, listed with TRL's in odb.private_api.
    check_classes("Trainer", Trainer)


def prepare_packed_rows(trainer: Trainer, attention: str) -> None:
    """Ready the model for odb's packed rows (``odb.packed.models.prepare_packed_model``: an sdpa/eager
    model switches to odb_varlen); a model whose packed samples see each other is refused with the fix
    for the collator that makes the rows."""
    from odb.packed.collate import PackedCollate
    from odb.packed.models import PackedLayoutError, prepare_packed_model

    model = trainer.model
    if model is None:
        return
    collator = trainer.data_collator
    name = type(collator).__name__
    collate = None
    if getattr(collator, "padding_free", False):
        what = "SFTConfig(padding_free=True)"
        fix = ("With TRL: set padding_free=False (odb then pads each batch to its longest sample), or load the model "
               "with an attn_implementation that isolates packed samples.")
    elif name == "DataCollatorWithFlattening":
        what = name
        collate = PackedCollate(use_cache=None)  # it passes no use_cache: the model's config decides
        fix = ("With the Trainer: collate with DataCollatorForLanguageModeling(mlm=False) or DataCollatorForSeq2Seq "
               "(odb then pads each batch to its longest sample).")
    else:
        what, fix = "layout='packed'", "Or use layout='padded'."
        collate = collator if isinstance(collator, PackedCollate) else None  # its rope index, if any, is probed
    try:
        prepare_packed_model(model, collate, attention=attention, samples=probe_samples(trainer.train_dataset))
    except PackedLayoutError as err:
        raise PackedLayoutError(f"{what} trains on packed rows, and {err} {fix}") from None


def probe_samples(dataset: Any, count: int = 8) -> List[Any]:
    """The first ``count`` samples of a map-style dataset (a VLM's packed-row probe looks for ones with images)."""
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__") \
            or not hasattr(dataset, "__getitem__"):
        return []  # a stream: no samples to try; the probe says what it needs
    return [dataset[i] for i in range(min(count, len(dataset)))]


BANNER_BATCH = "Instantaneous batch size per device"
BANNER_TOTAL = "Total train batch size"
BANNER_EPOCHS = f"Num Epochs = {sys.maxsize:,}"  # what the banner prints for the epochs odb leaves open under max_steps


class BannerLines(logging.Filter):
    """Rewrites the batch-size lines of the Trainer's train-start banner (logger ``transformers.trainer``),
    which print the unused ``per_device_train_batch_size``: odb sizes each batch by the token budget.

    Installed by ``log_batching`` right before the banner and removed by ``ProgressCallback.on_train_begin``
    right after it; a banner worded otherwise (another transformers) leaves the lines as they are, and
    ``finish`` then logs odb's line under the banner instead."""

    def __init__(self, cfg: ODBConfig, per_device: int, mean_per_step: Optional[int],
                 max_steps: Optional[int] = None) -> None:
        super().__init__("odb-banner")
        cost = "the sum of its samples' lengths: one packed row" if cfg.layout == "packed" else \
            "its samples x its longest sample, padded"
        g = cfg.global_batch_size
        if g is not None:  # the Trainer's optimizer steps, micro-batches planned inside each
            how = (f"each optimizer step's samples split into micro-batches of as many samples as fit "
                   f"token_budget={cfg.token_budget} tokens per process (a batch costs {cost}), as many micro-batches "
                   f"as the step's samples need (the logs' odb_mean_batch_size is the real batch size)")
        else:
            how = (f"as many samples as fit token_budget={cfg.token_budget} tokens per process (a batch costs "
                   f"{cost}), so the batch size varies from step to step; per_device_train_batch_size={per_device} "
                   f"is not used (the logs' odb_mean_batch_size is the real one)")
        self.batch_line = f"  {BANNER_BATCH} = set by odb: {how}"
        self.fallback_line = f"  odb: each batch holds {how}"
        if g is not None:
            self.total_line: Optional[str] = (f"  {BANNER_TOTAL} (w. parallel, distributed & accumulation) = {g:,} "
                                              f"(odb: global_batch_size, the samples of every optimizer step)")
        elif mean_per_step is None:
            self.total_line = None
        else:
            self.total_line = (f"  {BANNER_TOTAL} (w. parallel, distributed & accumulation) = about {mean_per_step:,} "
                               f"samples per optimizer step on average (odb: budget-filled steps, global_batch_size="
                               f"None; it varies)")
        self.epochs_line = None if max_steps is None else f"  Num Epochs = as many as max_steps={max_steps:,} takes"
        self.rewritten = False

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage().strip()
        if text.startswith(BANNER_BATCH):
            record.msg, record.args, self.rewritten = self.batch_line, (), True
        elif text.startswith(BANNER_TOTAL) and self.total_line is not None:
            record.msg, record.args = self.total_line, ()
        elif text == BANNER_EPOCHS and self.epochs_line is not None:
            record.msg, record.args = self.epochs_line, ()
        return True

    def finish(self) -> None:
        """Stop rewriting; log odb's line if the banner had no line to rewrite."""
        from transformers.trainer import logger

        logger.removeFilter(self)
        if not self.rewritten:
            logger.info(self.fallback_line)
            self.rewritten = True


def log_batching(run: ODBRun, per_device: int, mean_per_step: Optional[int], max_steps: Optional[int]) -> None:
    """Make the Trainer's banner, logged next, say how odb sizes the batches (see ``BannerLines``)."""
    from transformers.trainer import logger

    for old in [f for f in logger.filters if isinstance(f, BannerLines)]:  # a train() that stopped before its banner
        logger.removeFilter(old)
    run.banner = BannerLines(run.cfg, per_device, mean_per_step, max_steps)
    logger.addFilter(run.banner)
