"""odb in LLaMA-Factory's SFT training: ``CustomSeq2SeqTrainer`` and its data collators.

Three entry points (LLaMA-Factory itself is imported only by ``run_exp``):

- ``enable_odb(trainer=trainer, token_budget=...)``: a ``CustomSeq2SeqTrainer`` (any
  transformers Trainer) built by your own code switches to odb batches, in place, through
  ``odb.integrations.hf``, with the settings read from LLaMA-Factory's objects (``odb.enable_odb(trainer)``
  comes here for LLaMA-Factory's trainers); TRL's GRPO and RLOO trainers take odb's RL path, as through
  ``odb.enable_odb``;
- ``enable_odb(train_dataloader=loader, training_args=args, token_budget=...)``: a
  ``DataLoader(batch_size=B, collate_fn=SFTDataCollatorWith4DAttentionMask(...))`` of your
  own loop becomes an odb loader in place (``odb.apply``); returns its ``ODBHandle``;
- ``run_exp(args, token_budget=...)``: LLaMA-Factory's own ``run_exp`` (the code behind
  ``llamafactory-cli train``) for ``stage: sft``, with odb enabled on the trainer it builds.

What is read from LLaMA-Factory rather than asked of you:

- the collator's ``pad_to_multiple_of`` (8 when training) becomes odb's, so a batch's real
  padded shape stays within the budget;
- sample lengths come from the processed dataset's ``input_ids`` column (chat template,
  image tokens and ``cutoff_len`` truncation already applied), for the step estimate and
  an early check that every sample fits the budget;
- ``finetuning_args.disable_shuffling`` must agree with ``train_sampling_strategy``, and
  labels must be padded with ``IGNORE_INDEX`` (``ignore_pad_token_for_loss: true``) for the
  exact loss;
- ``neat_packing: true`` (the collator's ``neat_packing=True``) becomes odb's
  ``layout="packed"``: LLaMA-Factory's offline packing does not run (``run_exp`` builds
  the dataset unpacked), odb packs the samples online into one row per batch of at most
  ``token_budget`` tokens, collated by ``odb.PackedCollate`` (``position_ids`` restarting
  at each sample, each sample's first label masked, no attention mask: transformers
  turns the positions into the block-diagonal causal mask LLaMA-Factory's collator
  builds for sdpa/eager, and FlashAttention-2 reads them as LLaMA-Factory's own
  neat-packing path does). The model is probed once (``odb.check_packed_model``). A
  dataset LLaMA-Factory has already packed (``packing``/``neat_packing`` at
  ``get_dataset``: its rows carry ``position_ids``) is refused, as are multimodal
  templates and mrope models with neat packing.

Example:
    >>> from odb.integrations.llamafactory import enable_odb          # doctest: +SKIP
    >>> trainer = CustomSeq2SeqTrainer(model=model, args=training_args, finetuning_args=finetuning_args,
    ...                                data_collator=collator, **dataset_module, **tokenizer_module)  # doctest: +SKIP
    >>> enable_odb(trainer=trainer, token_budget=16384).train()       # doctest: +SKIP
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
from torch.utils.data import DataLoader

from odb.loader.apply import ODBHandle, apply
from odb.config import ODBConfig
from odb.plan.costs.cost import CostModel
from odb.loader.dataloader import make_config
from odb.packed.collate import PackedCollate
from odb.integrations.llamafactory_compat import import_llamafactory, swapped, transformers5_args, version_check_skipped
from odb.integrations.trainer_kinds import enable_hf, enable_rl, trainer_kind

__all__ = ["enable_odb", "import_llamafactory", "run_exp"]

IGNORE_INDEX = -100  # llamafactory.extras.constants.IGNORE_INDEX
_NOT_SFT = ("use_mca", "use_hyper_parallel")  # SFT workflows of LLaMA-Factory that build another trainer


def enable_odb(trainer: Any = None, train_dataloader: Optional[DataLoader] = None, training_args: Any = None,
               token_budget: Any = None, *, config: Optional[ODBConfig] = None,
               lengths: Optional[Sequence[int]] = None, **odb_options: Any) -> Any:
    """Train a LLaMA-Factory SFT trainer, or iterate a loader, with odb batches.

    Pass ``trainer`` (returns the trainer, switched in place) or ``train_dataloader``
    (returns the ``ODBHandle``; ``training_args`` then supplies
    ``gradient_accumulation_steps`` and the seed). ``token_budget`` and the other keyword
    options are ``odb.ODBConfig`` fields; ``lengths`` overrides the lengths read from the
    dataset's ``input_ids`` column.

    Example:
        >>> enable_odb(training_args=None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: enable_odb got neither trainer nor train_dataloader. Rule: ... Fix: pass trainer=...
    """
    if trainer is None and train_dataloader is None:
        raise TypeError("enable_odb got neither trainer nor train_dataloader. Rule: odb changes one of them. Fix: "
                        "pass trainer=<CustomSeq2SeqTrainer> (before trainer.train()) or "
                        "train_dataloader=<your DataLoader>.")
    if trainer is not None and train_dataloader is not None:
        raise ValueError("enable_odb got both trainer and train_dataloader. Rule: the trainer builds its own odb "
                         "loader from trainer.train_dataset. Fix: pass trainer alone, or train_dataloader alone for "
                         "a loop of your own.")
    options = dict(odb_options)
    if trainer is not None and trainer_kind(trainer) == "rl":  # GRPO, RLOO: odb cuts the policy update
        _check_training_args(trainer, training_args)
        return enable_rl(trainer, token_budget, config, lengths, options.pop("packed_attention", "odb_varlen"),
                         options)
    if trainer is not None:
        return _enable_trainer(trainer, training_args, token_budget, config, lengths, options)
    return _enable_loader(train_dataloader, training_args, token_budget, config, lengths, options)


def run_exp(args: Any = None, callbacks: Optional[List[Any]] = None, *, token_budget: Any = None,
            config: Optional[ODBConfig] = None, **odb_options: Any) -> None:
    """``llamafactory.train.tuner.run_exp`` for ``stage: sft`` with odb batching.

    ``args`` is what LLaMA-Factory's ``run_exp`` takes: a dict, an argv-style list, or None
    (then ``sys.argv[1]`` names a YAML/JSON config). While it runs, the SFT workflow builds
    ``CustomSeq2SeqTrainer`` through a subclass that calls ``enable_odb(trainer=...)``
    right after construction; the name is restored afterwards. With ``neat_packing: true``
    the workflow's ``get_dataset`` builds the dataset unpacked (odb packs the samples into
    rows online). Under ``torchrun`` call
    this from your script on every rank (``llamafactory-cli`` starts its own processes,
    which do not see it).

    Example:
        >>> from odb.integrations.llamafactory import run_exp                        # doctest: +SKIP
        >>> run_exp({"stage": "sft", "do_train": True, "model_name_or_path": "...",
        ...          "dataset": "alpaca_en_demo", "template": "llama3", ...}, token_budget=16384)  # doctest: +SKIP
    """
    skip_check = import_llamafactory()
    from llamafactory.extras.misc import is_env_enabled
    from llamafactory.hparams import read_args
    from llamafactory.train import tuner
    from llamafactory.train.sft import workflow

    parsed = transformers5_args(read_args(args))
    _check_stage(parsed, is_env_enabled)
    make_config(config, token_budget, dict(odb_options), "run_exp")  # bad options fail before the model loads
    base = workflow.CustomSeq2SeqTrainer
    built: List[Any] = []

    def init(self: Any, *a: Any, **kw: Any) -> None:
        base.__init__(self, *a, **kw)
        enable_odb(trainer=self, token_budget=token_budget, config=config, **odb_options)
        built.append(self)

    trainer_cls = type(base.__name__, (base,), {"__init__": init, "__module__": __name__})
    with swapped(workflow, "CustomSeq2SeqTrainer", trainer_cls), \
            swapped(workflow, "get_dataset", _unpacked_get_dataset(workflow.get_dataset)), \
            version_check_skipped(skip_check):  # LLaMA-Factory checks versions again while it runs
        tuner.run_exp(parsed, callbacks)
    if not built:
        raise RuntimeError("odb.integrations.llamafactory.run_exp finished without building a CustomSeq2SeqTrainer, "
                           "so odb was not used. Rule: it supports LLaMA-Factory's plain SFT workflow (stage: sft, "
                           "no Ray, no mcore_adapter). Fix: call enable_odb(trainer=...) in your own workflow.")


def _enable_trainer(trainer: Any, training_args: Any, token_budget: Any, config: Optional[ODBConfig],
                    lengths: Optional[Sequence[int]], options: Dict[str, Any]) -> Any:
    attention = options.pop("packed_attention", "odb_varlen")
    args = _check_training_args(trainer, training_args)
    finetuning = getattr(trainer, "finetuning_args", None)
    strategy = getattr(args, "train_sampling_strategy", "random")
    if getattr(finetuning, "disable_shuffling", False) and strategy != "sequential":
        raise ValueError(f"finetuning_args.disable_shuffling=True but training_args.train_sampling_strategy="
                         f"{strategy!r}. Rule: odb's loader orders samples by train_sampling_strategy (LLaMA-Factory's "
                         f"sequential sampler is not used). Fix: add `train_sampling_strategy: sequential` to the "
                         f"config, or drop disable_shuffling.")
    collator = getattr(trainer, "data_collator", None)
    packed = _packed_rows(collator, getattr(trainer, "train_dataset", None), config, options)
    options = _packed_options(options) if packed else _collator_options(collator, config, options)
    cfg = make_config(config, token_budget, dict(options), "enable_odb")
    if lengths is None and cfg.length_fn is None:
        lengths = _dataset_lengths(getattr(trainer, "train_dataset", None))
    _check_fits(lengths, cfg)
    if not packed:
        return enable_hf(trainer, token_budget, config, lengths, attention, options)
    _prepare_packed_model(getattr(trainer, "model", None), attention)
    trainer.data_collator = PackedCollate(ignore_index=IGNORE_INDEX)  # odb's row replaces LLaMA-Factory's packing
    try:
        return enable_hf(trainer, token_budget, config, lengths, attention, options)
    except BaseException:
        trainer.data_collator = collator
        raise


def _check_training_args(trainer: Any, training_args: Any) -> Any:
    """``trainer.args``, after refusing other ``training_args`` than those."""
    args = getattr(trainer, "args", None)
    if training_args is not None and training_args is not args:
        raise ValueError("enable_odb got training_args that are not trainer.args. Rule: odb follows the arguments "
                         "the trainer runs with. Fix: pass trainer alone (or build the trainer with those args).")
    return args


# ---- a loader of your own ------------------------------------------------------------------
def _enable_loader(loader: DataLoader, training_args: Any, token_budget: Any, config: Optional[ODBConfig],
                   lengths: Optional[Sequence[int]], options: Dict[str, Any]) -> ODBHandle:
    attention = options.pop("packed_attention", "odb_varlen")
    collator = getattr(loader, "collate_fn", None)
    packed = _packed_rows(collator, getattr(loader, "dataset", None), config, options)
    options = _packed_options(options) if packed else _collator_options(collator, config, options)
    if training_args is not None:
        if "gradient_accumulation_steps" not in options and config is None:
            # the Trainer's samples per optimizer step (global_batch_size), as enable_odb(trainer) takes them
            from odb.integrations.hf.steps import trainer_steps

            options.update(trainer_steps(training_args, config, options))
        if "seed" not in options and (config is None or config.seed is None):
            data_seed = getattr(training_args, "data_seed", None)
            options["seed"] = int(data_seed if data_seed is not None else training_args.seed)
    if "shift_labels" not in options and config is None:
        options["shift_labels"] = _shifts_labels(collator)
    cfg = make_config(config, token_budget, dict(options), "enable_odb")
    if lengths is None and cfg.length_fn is None:
        lengths = _dataset_lengths(getattr(loader, "dataset", None))
    _check_fits(lengths, cfg)
    if packed:
        _prepare_packed_model(getattr(collator, "model", None), attention)
        options["collate_fn"] = PackedCollate(ignore_index=IGNORE_INDEX)
    return apply(loader, token_budget, config=config, lengths=lengths, **options)


# ---- what LLaMA-Factory's objects say ------------------------------------------------------------
def _collator_options(collator: Any, config: Optional[ODBConfig], options: Dict[str, Any]) -> Dict[str, Any]:
    """odb options implied by a LLaMA-Factory (or transformers Seq2Seq) collator, checked against the user's."""
    out = dict(options)
    if collator is None:
        return out
    name = type(collator).__name__
    pad = getattr(collator, "pad_to_multiple_of", None) or 1
    # A config's pad_to_multiple_of=1 is its default, not a choice: the collator's value replaces it.
    given = out.get("pad_to_multiple_of", config.pad_to_multiple_of if config is not None else 1)
    if "pad_to_multiple_of" not in out and given == 1:
        if pad > 1:
            out["pad_to_multiple_of"] = int(pad)
    elif given % pad:
        raise ValueError(f"odb got pad_to_multiple_of={given} but {name} pads to a multiple of {pad}. Rule: odb's "
                         f"padded length must not be shorter than the collator's, or batches exceed token_budget. "
                         f"Fix: pass pad_to_multiple_of={pad} (or a multiple of it), or leave it out.")
    label_pad = getattr(collator, "label_pad_token_id", IGNORE_INDEX)
    scaling = out.get("loss_scaling", config.loss_scaling if config is not None else "exact")
    ignore = out.get("ignore_index", config.ignore_index if config is not None else IGNORE_INDEX)
    if label_pad != ignore and scaling in ("exact", "approx"):
        raise ValueError(f"{name} pads labels with label_pad_token_id={label_pad}, not {ignore}, so padding counts "
                         f"as supervised tokens and each batch's loss depends on its padding. Rule: "
                         f"loss_scaling={scaling!r} needs padding left out of the loss. Fix: set "
                         f"`ignore_pad_token_for_loss: true` (LLaMA-Factory's default), or pass loss_scaling='none'.")
    return out


def _packed_rows(collator: Any, dataset: Any, config: Optional[ODBConfig], options: Dict[str, Any]) -> bool:
    """Whether batches are odb's packed rows: the collator's neat_packing, or layout='packed'; checked."""
    name = type(collator).__name__
    neat = bool(getattr(collator, "neat_packing", False))
    layout = options.get("layout", config.layout if config is not None else None)
    _check_not_prepacked(dataset)
    if neat and options.get("layout") == "padded":
        raise ValueError(f"odb got layout='padded' but {name} has neat_packing=True. Rule: with odb, LLaMA-Factory's "
                         f"neat_packing is odb's layout='packed' (one padding-free row per batch, filled to "
                         f"token_budget). Fix: leave layout out, or set `neat_packing: false` for padded batches.")
    if not (neat or layout == "packed"):
        return False
    plugin = getattr(getattr(collator, "template", None), "mm_plugin", None)
    media = [t for t in ("image_token", "video_token", "audio_token") if getattr(plugin, t, None) is not None]
    if media or getattr(collator, "get_rope_func", None) is not None:
        what = f"a multimodal template ({', '.join(media)})" if media else "an mrope model (3-D position_ids)"
        raise ValueError(f"odb cannot pack rows for {name} with {what}. Rule: odb's packed row "
                         f"(odb.PackedCollate) holds token ids, labels and 1-D position_ids only, and LLaMA-Factory "
                         f"computes media inputs and mrope positions inside its collator. Fix: set "
                         f"`neat_packing: false` (odb pads each batch; the collator runs as usual).")
    ignore = options.get("ignore_index", config.ignore_index if config is not None else IGNORE_INDEX)
    if ignore != IGNORE_INDEX:
        raise ValueError(f"odb got ignore_index={ignore} with packed rows. Rule: each sample's first label is set to "
                         f"{IGNORE_INDEX}, the label the model's loss ignores. Fix: leave ignore_index out.")
    return True


def _packed_options(options: Dict[str, Any]) -> Dict[str, Any]:
    """odb options for packed rows: layout='packed'; a packed row has no padding to round."""
    pad = options.get("pad_to_multiple_of", 1)
    if pad != 1:
        raise ValueError(f"odb got pad_to_multiple_of={pad} with neat_packing (layout='packed'). Rule: a packed row "
                         f"has no padding, and its cost is the sum of its samples' lengths. Fix: leave "
                         f"pad_to_multiple_of out.")
    return {**options, "layout": "packed"}


def _check_not_prepacked(dataset: Any) -> None:
    """Refuse a dataset that LLaMA-Factory's PackedSupervisedDatasetProcessor has packed into rows already."""
    datasets = sys.modules.get("datasets")
    if datasets is None or not isinstance(dataset, datasets.Dataset) or "position_ids" not in dataset.column_names:
        return
    raise ValueError("the training dataset is already packed into rows by LLaMA-Factory (its "
                     "PackedSupervisedDatasetProcessor wrote a position_ids column: `packing` or `neat_packing` was "
                     "true when get_dataset ran), so every sample odb sees is a row of about cutoff_len tokens and a "
                     "token budget has nothing left to group. Rule: odb batches (and, for neat_packing, packs) the "
                     "samples itself, online. Fix: use odb.integrations.llamafactory.run_exp (it builds the dataset "
                     "unpacked for `neat_packing: true`), or run get_dataset with data_args.packing = "
                     "data_args.neat_packing = False and keep neat_packing=True on the collator; replace "
                     "`packing: true` by `neat_packing: true` (odb never lets packed samples attend to each other).")


def _prepare_packed_model(model: Any, attention: str) -> None:
    """Ready the model for neat_packing's packed rows (``odb.packed.models.prepare_packed_model``: an sdpa/eager
    model is switched to ``odb_varlen`` unless ``attention="model"``), or refuse a model whose packed samples see
    each other."""
    if model is None:
        return
    from odb.packed.models import PackedLayoutError, prepare_packed_model

    try:
        prepare_packed_model(model, attention=attention)
    except PackedLayoutError as err:
        raise PackedLayoutError(f"neat_packing: true trains on odb's packed rows, and {err} With LLaMA-Factory: set "
                                f"`neat_packing: false` (odb then pads each batch to its longest sample), or load "
                                f"the model with an attention implementation that isolates packed samples "
                                f"(`flash_attn: fa2`).") from None


def _shifts_labels(collator: Any) -> bool:
    # LLaMA-Factory's SFT models are causal LMs, whose loss drops each row's first label.
    model = getattr(collator, "model", None)
    return not bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def _dataset_lengths(dataset: Any) -> Optional[np.ndarray]:
    """Token counts from a processed HF dataset's ``input_ids`` column (None for anything else)."""
    datasets = sys.modules.get("datasets")  # a datasets.Dataset means the package is imported already
    if datasets is None or not isinstance(dataset, datasets.Dataset) or "input_ids" not in dataset.column_names:
        return None
    import pyarrow.compute as pc

    column = dataset.with_format("arrow")["input_ids"]
    return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)


def _check_fits(lengths: Optional[Sequence[int]], cfg: ODBConfig) -> None:
    """Refuse, before training starts, a sample that alone exceeds the budget (oversize='error')."""
    if lengths is None or cfg.oversize != "error" or len(lengths) == 0 or len(cfg.token_budgets) != 1:
        return
    values = np.asarray(lengths, dtype=np.int64).reshape(-1, 1)
    cost = CostModel.from_config(cfg)
    fit = cost.copies_that_fit_unrounded(cost.pad(values))
    if fit.min() >= 1:
        return
    index = int(np.argmin(fit))
    padded = cost.pad(values)
    needed = int(np.ceil(cost.token_weight(padded).max()))  # the padded length, or more with quadratic_length
    raise ValueError(f"sample {index} has {int(values[index, 0])} tokens ({int(padded[index, 0])} once padded to a "
                     f"multiple of {cfg.pad_to_multiple_of}), more than token_budget={cfg.token_budget} allows for "
                     f"one sample. Rule: every batch, even of one sample, stays within the budget (oversize='error'). "
                     f"Fix: raise token_budget to at least {needed} (the longest sample, cutoff_len at most, padded), "
                     f"lower cutoff_len, or pass oversize='alone'.")


def _check_stage(parsed: Any, is_env_enabled: Any) -> None:
    if isinstance(parsed, dict):
        stage = parsed.get("stage", "sft")
        extra = [flag for flag in _NOT_SFT if parsed.get(flag)]
    else:
        argv = [str(a) for a in parsed]
        stage = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--stage"),
                     next((a.split("=", 1)[1] for a in argv if a.startswith("--stage=")), "sft"))
        extra = [flag for flag in _NOT_SFT if f"--{flag}" in argv]
    if is_env_enabled("USE_MCA"):
        extra.append("USE_MCA=1")
    if is_env_enabled("USE_RAY"):
        extra.append("USE_RAY=1")
    if stage != "sft" or extra:
        raise ValueError(f"odb.integrations.llamafactory.run_exp got stage={stage!r}{' with ' if extra else ''}"
                         f"{', '.join(extra)}. Rule: it runs LLaMA-Factory's plain SFT workflow, whose "
                         f"CustomSeq2SeqTrainer it switches to odb. Fix: use stage: sft without Ray/mcore_adapter/"
                         f"hyper_parallel, or call enable_odb(trainer=...) on the trainer of your own workflow.")


def _unpacked_get_dataset(get_dataset: Any) -> Any:
    """LLaMA-Factory's get_dataset, building the dataset unpacked for ``neat_packing: true`` (odb packs online).

    ``DataArguments`` turns ``neat_packing`` into ``packing`` and takes one token off
    ``cutoff_len`` for its packed rows; both are undone while the dataset is built (each
    sample is truncated to the ``cutoff_len`` of the config) and restored afterwards, so
    the collator built next still sees ``neat_packing=True``.
    """

    def unpacked(template: Any, model_args: Any, data_args: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(data_args, "neat_packing", False):
            return get_dataset(template, model_args, data_args, *args, **kwargs)
        packing, cutoff = data_args.packing, data_args.cutoff_len
        data_args.packing, data_args.neat_packing, data_args.cutoff_len = False, False, cutoff + 1
        try:
            return get_dataset(template, model_args, data_args, *args, **kwargs)
        finally:
            data_args.packing, data_args.neat_packing, data_args.cutoff_len = packing, True, cutoff

    return unpacked
