"""odb in the HuggingFace ``transformers`` Trainer: token-budget micro-batches, exact loss, the Trainer's steps.

Example:
    >>> from odb.integrations.hf import ODBTrainer, enable_odb      # doctest: +SKIP
    >>> trainer = ODBTrainer(model=model, args=args, train_dataset=ds, data_collator=collator,
    ...                      token_budget=8192, buffer_size=512)     # doctest: +SKIP
    >>> trainer = enable_odb(Seq2SeqTrainer(...), token_budget=(4096, 4096),
    ...                      length_fn=odb.seq2seq_lengths)          # doctest: +SKIP
    >>> trainer.train()                                              # doctest: +SKIP

What changes in the Trainer (training only; evaluation and prediction are untouched):

- the training loader is an ``odb.ODBDataLoader`` over an ``odb.ShardSampler`` (under
  ``group_by_length`` and ``batch_rebalance``: the Trainer's own sampler, dealt to the ranks as
  Accelerate deals it, odb.integrations.hf.sampling), not passed through ``accelerator.prepare``,
  which would re-shard odb's batches;
- each micro-batch's loss is the model's mean over its supervised tokens times
  ``ODBStepInfo.loss_scale``: the gradient is the exact token mean over all ranks and
  micro-batches of the optimizer step, whether or not the model reads
  ``num_items_in_batch`` and whatever ``average_tokens_across_devices`` says;
- with the user's batch (``global_batch_size``, the default: the Trainer's
  ``per_device_train_batch_size x gradient_accumulation_steps x world size`` samples per
  optimizer step) the steps are the Trainer's, counted exactly, so its learning-rate
  schedule, warmup, ``num_train_epochs`` and ``max_steps`` run unchanged; with budget-filled
  steps (``global_batch_size=None``, asked for by name) ``num_train_epochs`` means passes over
  the data and the schedule (warmup and decay) runs on the share of samples seen
  (``ODBRun.schedules_by_samples``); ``max_steps`` (when set) counts optimizer steps either way;
- the Trainer's logs gain ``odb_padding_ratio``, ``odb_real_tokens_per_second``,
  ``odb_samples_per_second``, ``odb_mean_batch_size`` and ``odb_ghost_steps``;
- checkpoints hold ``odb_state_rank{R}.json``; ``train(resume_from_checkpoint=...)``
  continues the interrupted epoch exactly (the Trainer's batch skipping is not used).
- under DDP without ``find_unused_parameters``, FSDP or DeepSpeed, a vision-language model's
  micro-batch without images gets a dummy image that adds exactly zero (``odb.integrations.vlm``).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from odb.config import CONFIG_FIELDS, ODBConfig
from odb.data.lengths import check_length_dims, seq2seq_lengths
from odb.loader.dataloader import ODBDataLoader, make_config
from odb.step_info import ODBStepInfo
from odb.train.loss import weigh_loss
from odb.integrations.hf.collators import collator_label, collator_options, collator_rules
from odb.integrations.hf.data import build_train_loader, check_fits, epoch_emitted, estimate_micro_steps, read_state, write_state
from odb.integrations.hf.progress import SampleProgress, schedule_by_samples
from odb.integrations.hf.sampling import check_strategy, replay_order
from odb.integrations.memory import auto_meter_options, measure_auto_explicitly
from odb.integrations.hf.setup import (ODBRun, ProgressCallback, check_args, check_loop_api, configure_trainer, log_batching,
                       loss_shifts_labels, prepare_packed_rows)
from odb.integrations.hf.steps import (SampleView, StepBundle, StepFiller, check_loss_tokens, next_step, pad_step,
                                       recount_loss_tokens, trainer_steps)
from odb.integrations.trl.pairs import check_pairs_fit, pair_options, pair_trainer, ragged_gather
from odb.integrations.trl.rules import check_trl_trainer, sft_computes_loss, sft_options

__all__ = ["ODBTrainer", "ODBTrainerMixin", "collator_options", "configure_trainer", "enable_odb"]


class ODBTrainerMixin:
    """Put before a Trainer class: ``class MyTrainer(ODBTrainerMixin, Seq2SeqTrainer)``.

    Keyword arguments that are ODBConfig fields (``token_budget``, ``buffer_size``,
    ``length_fn``...), ``odb_config=``, ``lengths=`` (per-sample lengths, saves
    probing the dataset for the step estimate) and ``packed_attention=`` (see
    ``enable_odb``) go to odb; the rest to the Trainer.

    Example:
        >>> from odb.integrations.hf import ODBTrainerMixin                 # doctest: +SKIP
        >>> class MyTrainer(ODBTrainerMixin, Seq2SeqTrainer): pass         # doctest: +SKIP
        >>> MyTrainer(model=m, args=a, train_dataset=ds, token_budget=4096)  # doctest: +SKIP
    """

    _odb: Optional[ODBRun] = None

    def __init__(self, *args: Any, token_budget: Any = None, odb_config: Optional[ODBConfig] = None,
                 lengths: Optional[Sequence[int]] = None, packed_attention: str = "odb_varlen",
                 **kwargs: Any) -> None:
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in CONFIG_FIELDS}
        super().__init__(*args, **kwargs)
        self._odb_enable(token_budget, odb_config, lengths, options, packed_attention)

    # ---- public ----------------------------------------------------------------------
    @property
    def odb_config(self) -> ODBConfig:
        """The options odb batches the training data with."""
        return self._odb.cfg

    @property
    def odb_loader(self) -> Optional[ODBDataLoader]:
        """The training loader of the last ``train()`` call (``odb_loader.odb_stats``: epoch counters)."""
        return self._odb.loader

    @property
    def odb_step_infos(self) -> Tuple[ODBStepInfo, ...]:
        """Step infos of this rank's micro-batches in the last optimizer step."""
        return self._odb.steps.step

    # ---- setup -----------------------------------------------------------------------
    def _odb_enable(self, token_budget: Any, config: Optional[ODBConfig], lengths: Optional[Sequence[int]],
                    options: Dict[str, Any], packed_attention: str = "odb_varlen") -> None:
        check_loop_api()
        check_trl_trainer(self)  # TRL's RL trainers (and others not shown exact): refused
        check_args(self)
        args = self.args
        accumulation = args.gradient_accumulation_steps
        given = options.get("gradient_accumulation_steps", config.gradient_accumulation_steps if config else None)
        if given is not None and given != accumulation and ("gradient_accumulation_steps" in options or given != 1):
            raise ValueError(f"odb got gradient_accumulation_steps={given} but the Trainer accumulates "
                             f"{accumulation} micro-batches (args.gradient_accumulation_steps). Rule: odb follows the "
                             f"Trainer's value. Fix: set it only in TrainingArguments.")
        options.update(trainer_steps(args, config, options))
        if "seed" not in options and (config is None or config.seed is None):
            options["seed"] = args.data_seed if args.data_seed is not None else args.seed
        shift = loss_shifts_labels(self)
        options = sft_options(self, config, options, shift)  # TRL's collator: its labels, padding-free rows
        options = pair_options(self, config, token_budget, lengths, options)  # DPO, reward: a pair is 2 rows
        rules = collator_rules(self.data_collator, shift_labels=shift, config=config, options=options)
        if rules is not None:  # one of transformers' collators: the supervised tokens it trains on
            options = rules.options
        if "shift_labels" not in options and (config is None or not config.shift_labels):
            options["shift_labels"] = shift
        if "length_fn" not in options and (config is None or config.length_fn is None) and lengths is None and \
                getattr(getattr(self.model, "config", None), "is_encoder_decoder", False):
            options["length_fn"] = seq2seq_lengths  # an encoder-decoder's targets count against the budget too
        # token_budget="auto" off CUDA: the Trainer's model is known, so its activations are the meter
        options = auto_meter_options(token_budget, config, options, self.model, args.device)
        cfg = make_config(config, token_budget, options, "enable_odb")
        check_length_dims(cfg.token_budgets, cfg.length_fn, lengths)
        check_strategy(self, cfg)  # group_by_length, batch_rebalance: their steps need the Trainer's
        check_fits(self, cfg, lengths)
        check_pairs_fit(self, cfg)
        if cfg.layout == "packed":
            prepare_packed_rows(self, packed_attention)
        self._odb = ODBRun(cfg, lengths, shift)
        self._odb.count_after_collate = rules is not None and rules.count_after_collate
        self._odb.pairs = pair_trainer(self) is not None
        self._odb.collator_name = rules.name if rules is not None else collator_label(self.data_collator)
        self.loss_is_scaled_for_ga = True  # loss_scale already covers accumulation: no division by the Trainer
        self.callback_handler.callbacks.insert(0, ProgressCallback(self._odb))

    # ---- data and step counts ----------------------------------------------------------
    def get_train_dataloader(self) -> ODBDataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        self._odb.loader = build_train_loader(self, self._odb.cfg, self._odb.lengths)
        # "auto": the Trainer pulls a step's micro-batches (get_batch_samples) before it trains them, so each is
        # measured by training_step; it holds at most the step's micro-batches and one fetched ahead (Accelerate's
        # prepared loader reads one batch ahead to know the last).
        self._odb.auto = measure_auto_explicitly(self._odb.loader, self.args.gradient_accumulation_steps + 1)
        return self._odb.loader

    def set_initial_training_values(self, args: TrainingArguments, dataloader: Any) -> tuple:
        run = self._odb
        if dataloader is not run.loader:
            return super().set_initial_training_values(args, dataloader)
        accumulation = args.gradient_accumulation_steps
        micro = estimate_micro_steps(dataloader, run.cfg, run.lengths, args.world_size)
        dataset = dataloader.dataset
        n = len(dataset) if micro is not None else None
        updates = max(1, -(-micro // accumulation)) if micro is not None else None
        exact = dataloader.odb_optimizer_steps  # global_batch_size: the user's optimizer steps, counted exactly
        if exact is not None:
            updates = max(1, exact)
        if args.max_steps > 0:
            max_steps, epochs, target = args.max_steps, sys.maxsize, None
        elif updates is None:
            raise ValueError(f"odb cannot count the epochs of a training dataset without a length "
                             f"({type(dataset).__name__}). Fix: set TrainingArguments(max_steps=...).")
        else:
            max_steps = max(1, math.ceil(args.num_train_epochs * updates))
            epochs, target = math.ceil(args.num_train_epochs), float(args.num_train_epochs)
        per_step = max(1, round(n / updates)) if n else accumulation * args.world_size
        if run.cfg.global_batch_size is not None:
            per_step = run.cfg.global_batch_size
        run.progress = SampleProgress(target, n or 1)
        run.window.reset()
        log_batching(run, args.per_device_train_batch_size, per_step if n else None,
                     args.max_steps if args.max_steps > 0 else None)
        samples = round(n * args.num_train_epochs) if target else per_step * max_steps
        return epochs, updates or max_steps, n or samples, samples, per_step, micro or max_steps * accumulation, \
            max_steps

    def _init_training_state(self, *args: Any, **kwargs: Any) -> Tuple[int, int]:
        epochs_trained, skipped = super()._init_training_state(*args, **kwargs)
        run = self._odb
        if run.loader is None:
            return epochs_trained, skipped
        bound = inspect.signature(Trainer._init_training_state).bind(self, *args, **kwargs)
        checkpoint = bound.arguments.get("resume_from_checkpoint")
        run.epoch.resume, run.epoch.rng_checkpoint = False, None
        if checkpoint is None:
            return 0, 0
        fresh = bool(self.args.ignore_data_skip)
        saved = read_state(checkpoint, self.args.process_index, self.args.world_size, strict=not fresh)
        if saved is None:
            raise ValueError(f"checkpoint {checkpoint} has no odb state (odb_state_rank*.json): it was saved "
                             f"without odb, so odb cannot tell where the data stopped. Fix: resume from a checkpoint "
                             f"saved by an odb Trainer, or load the weights with from_pretrained and start afresh.")
        progress = run.progress
        progress.load_state_dict(saved["progress"])
        if progress.in_epoch and epoch_emitted(saved["loader"]):
            progress.end_epoch()  # the loader had emitted the whole epoch: the next one starts afresh
        if progress.reached():
            return math.ceil(progress.target_epochs), 0
        epoch = progress.next_epoch()
        if progress.in_epoch and fresh:
            progress.begin_epoch(epoch)  # ignore_data_skip: the interrupted epoch starts again
        elif progress.in_epoch:
            replay_order(run.loader, saved, checkpoint, self.args.world_size)  # group_by_length's order, drawn again
            run.loader.load_state_dict(saved["loader"])
            run.epoch.resume, run.epoch.rng_checkpoint = True, checkpoint
        return epoch, 0

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        run = self._odb
        kwargs = dict(inspect.signature(Trainer._run_epoch).bind(self, *args, **kwargs).arguments)
        kwargs.pop("self")
        if kwargs.get("train_dataloader") is not run.loader or run.loader is None:
            return super()._run_epoch(**kwargs)
        if not run.epoch.resume:
            run.progress.begin_epoch(kwargs["epoch"])
        run.epoch.first_pull, run.epoch.resume, run.epoch.exhausted = run.epoch.resume, False, False
        # The epoch ends when odb's data does (get_batch_samples asks the Trainer to stop it);
        # odb does the resume itself, so the Trainer must not skip batches.
        kwargs.update(steps_in_epoch=sys.maxsize, num_update_steps_per_epoch=sys.maxsize,
                      steps_trained_in_current_epoch=0)
        return super()._run_epoch(**kwargs)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple:
        run = self._odb
        if run.loader is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        run.steps.by_batch.clear()
        if run.epoch.first_pull and run.epoch.rng_checkpoint is not None:
            # The Trainer restored the checkpoint's RNG states before it built the resumed epoch's iterator,
            # and building it drew from torch's RNG (a DataLoader draws its base seed at iter()); the
            # uninterrupted run drew that at the epoch's start. Restore them again before the first batch:
            # dropout (and a collator drawing on the training thread) continue as the interrupted run did.
            self._load_rng_state(run.epoch.rng_checkpoint)
            run.epoch.rng_checkpoint = None
        got = next_step(epoch_iterator, run.cfg.step_info_key)
        run.epoch.empty_resume, run.epoch.first_pull = run.epoch.first_pull and got is None, False
        if got is None:
            run.epoch.exhausted = True
            self.control.should_epoch_stop = True
            return [], None
        batches, infos = got
        try:
            if run.count_after_collate:  # masked LM, left padding: the collated labels are the only count
                infos = recount_loss_tokens(batches, infos, run.cfg, run.shift, self._odb_sum)
            check_loss_tokens(batches, infos, run.cfg, run.shift, SampleView(self.train_dataset, run.collator_name))
        except ValueError as err:
            run.loader.odb_abort(err)  # the other ranks stop at their next exchange instead of waiting there
            raise
        run.steps.by_batch.update((id(b), i) for b, i in zip(batches, infos))
        run.steps.step = tuple(infos)
        run.window.add(infos)
        run.progress.add(sum(i.all_samples_this_step for i in infos))
        name = getattr(self.model, "main_input_name", "input_ids")
        return pad_step(batches, self.args.gradient_accumulation_steps, name), None

    def _track_num_input_tokens(self, inputs: Any) -> None:
        for part in (inputs.parts if isinstance(inputs, StepBundle) else (inputs,)):
            super()._track_num_input_tokens(part)

    def _odb_sum(self, value: int) -> int:
        """``value`` summed over the ranks (one all-reduce; the value itself on one process)."""
        if self.args.world_size <= 1:
            return value
        total = torch.tensor(value, dtype=torch.int64, device=self.args.device)
        return int(self.accelerator.reduce(total, reduction="sum"))

    # ---- loss ----------------------------------------------------------------------------
    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        run = self._odb
        if isinstance(inputs, StepFiller):
            return torch.zeros((), device=self.args.device)
        if isinstance(inputs, StepBundle):  # more micro-batches than the Trainer's slots: several in one slot
            loss = torch.zeros((), device=self.args.device)
            for k, part in enumerate(inputs.parts):
                last = k == len(inputs.parts) - 1  # the slot's own sync context holds for its last part
                with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                    loss = loss + self.training_step(model, part, num_items_in_batch)
            return loss
        info = run.steps.by_batch.pop(id(inputs), None)
        if info is None:
            return super().training_step(model, inputs, num_items_in_batch)
        # The model averages over this batch's own supervised tokens, whether or not it reads
        # num_items_in_batch; loss_scale then turns that mean into its share of the exact mean.
        count = torch.tensor(max(info.local_loss_tokens, 1), device=self.args.device)
        self.current_gradient_accumulation_steps = 1  # Trainers without loss_is_scaled_for_ga divide by it
        run.steps.active = info
        if run.auto is not None:
            run.auto.begin(info.step, info.is_ghost)
        try:
            return super().training_step(model, inputs, count)  # forward and backward
        finally:
            run.steps.active = None
            if run.auto is not None:
                run.auto.end()

    def compute_loss(self, model: torch.nn.Module, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        info = self._odb.steps.active
        if info is None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        pairs = self._odb.pairs
        if pairs or sft_computes_loss(self):
            # TRL >= 1.15 computes the loss itself (fused LM head, no logits): asking for its outputs costs a
            # FutureWarning and an extra forward; its loss is finite without supervised tokens, so zero_loss needs none.
            # SFT's cross-rank factor applies whenever average_tokens_across_devices (odb always passes the count);
            # DPO and the reward trainer average per pair on each rank, with no such factor (odb.integrations.trl.pairs).
            with ragged_gather(self.accelerator) if pairs else contextlib.nullcontext():  # per-pair metrics
                got = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                           num_items_in_batch=num_items_in_batch)
            loss, outputs = got if return_outputs else (got, None)
            rescaled = self.args.average_tokens_across_devices and not pairs
        else:
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
            rescaled = self.args.average_tokens_across_devices and (self.model_accepts_loss_kwargs or
                                                                     self.compute_loss_func)
        if rescaled:
            loss = loss / self.accelerator.num_processes  # undo the Trainer's own cross-rank factor
        loss = weigh_loss(loss, info, outputs=outputs)  # an exact zero from the logits when it adds nothing
        return (loss, outputs) if return_outputs else loss

    def floating_point_ops(self, inputs: Any) -> int:
        if isinstance(inputs, StepBundle):
            return sum(self.floating_point_ops(part) for part in inputs.parts)
        return 0 if isinstance(inputs, StepFiller) else super().floating_point_ops(inputs)

    # ---- schedule, logs, checkpoints --------------------------------------------------------
    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        created = self.lr_scheduler is None
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        # The user's batch (global_batch_size): the Trainer's steps, counted exactly, so its schedule runs as it is.
        # Budget-filled steps: their number is an estimate, so the schedule reads the share of samples seen.
        if created and self._odb.schedules_by_samples and isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            scheduler.lr_lambdas = [schedule_by_samples(f, num_training_steps, self._odb.progress)
                                    for f in scheduler.lr_lambdas]
        return scheduler

    def log(self, logs: Dict[str, float], start_time: Optional[float] = None) -> None:
        run = self._odb
        if run.loader is not None and "loss" in logs and "learning_rate" in logs:  # a training log line
            totals = torch.tensor(run.window.values(), dtype=torch.int64, device=self.args.device)
            if self.args.world_size > 1:
                totals = self.accelerator.reduce(totals, reduction="sum")
            logs.update(run.window.logs(totals.tolist()))
        super().log(logs, start_time)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        run = self._odb
        if run.loader is not None:
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            folder = os.path.join(self._get_output_dir(trial=trial), name)
            write_state(folder, self.args.process_index, self.args.world_size, run.loader, run.progress.state_dict())


class ODBTrainer(ODBTrainerMixin, Trainer):
    """``transformers.Trainer`` with odb batching: ``ODBTrainer(..., token_budget=8192, **odb_options)``.

    Example:
        >>> trainer = ODBTrainer(model=model, args=args, train_dataset=ds, data_collator=collator,
        ...                      token_budget=8192)                   # doctest: +SKIP
    """


_CLASSES: Dict[type, type] = {}


def enable_odb(trainer: Trainer, token_budget: Any = None, *, config: Optional[ODBConfig] = None,
               lengths: Optional[Sequence[int]] = None, packed_attention: str = "odb_varlen",
               **odb_options: Any) -> Trainer:
    """Switch an existing Trainer (any subclass) to odb training, in place; returns it.

    Only this trainer changes: its class becomes a subclass ``ODB<Class>`` made with
    ``ODBTrainerMixin`` (the Trainer class itself and its other instances are untouched).
    ``gradient_accumulation_steps`` comes from ``trainer.args``; ``seed`` defaults to
    ``args.data_seed`` or ``args.seed``; ``shift_labels`` to whether the model's loss
    shifts labels (causal LM); ``length_fn`` to ``odb.seq2seq_lengths`` for an
    encoder-decoder model (source and target both count against the budget; an int
    budget bounds their sum) unless ``length_fn`` or ``lengths`` is given.

    transformers' ``DataCollatorForLanguageModeling`` (causal and masked),
    ``DataCollatorWithPadding``, ``DataCollatorForSeq2Seq``, ``DataCollatorWithFlattening``
    and TRL's collators are recognised: odb counts the supervised tokens they train on
    (``odb.integrations.hf.collators``) and takes their ``pad_to_multiple_of``. A sample
    that alone exceeds the budget is refused here when the lengths are known cheaply
    (``lengths``, a ``datasets.Dataset`` with ``input_ids``). Packed rows (TRL's
    ``padding_free``, ``DataCollatorWithFlattening``, ``layout="packed"``) switch an
    ``sdpa``/``eager`` model to ``"odb_varlen"`` attention, logged once;
    ``packed_attention="model"`` keeps the model's attention.

    Example:
        >>> trainer = enable_odb(Trainer(model=m, args=a, train_dataset=ds, data_collator=c),
        ...                      token_budget=8192, buffer_size=512)  # doctest: +SKIP
    """
    if not isinstance(trainer, Trainer):
        raise TypeError(f"enable_odb got {type(trainer).__name__}, not a transformers.Trainer. "
                        f"Fix: pass the Trainer instance (or build odb.integrations.hf.ODBTrainer).")
    if isinstance(trainer, ODBTrainerMixin) and trainer._odb is not None:
        raise ValueError("enable_odb got a Trainer that already uses odb. Fix: enable it once.")
    check_trl_trainer(trainer)  # before its class changes: a refused trainer stays as it was
    if not isinstance(trainer, ODBTrainerMixin):
        cls = type(trainer)
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"ODB{cls.__name__}", (ODBTrainerMixin, cls), {"__module__": __name__})
        trainer.__class__ = _CLASSES[cls]
    trainer._odb_enable(token_budget, config, lengths, dict(odb_options), packed_attention)
    return trainer
