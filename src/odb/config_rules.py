"""The rule of every ODBConfig option, checked when a config is made (``validate``).

Each check names the option, its value, the rule it breaks and the fix (``ODBConfig.<name>=<value>:
<rule>. Fix: <fix>.``). A few options are normalized here (a bucket count becomes its buckets, a
schedule its tuple of steps), which is why ``validate`` may set fields of the frozen config.

Example:
    >>> from odb.config import ODBConfig
    >>> ODBConfig(token_budget=0)
    Traceback (most recent call last):
    ...
    ValueError: ODBConfig.token_budget=0: must be >= 1. Fix: pass a positive number of tokens, e.g. token_budget=16384.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any

from odb.plan.steps.composition import COMPOSITIONS

if TYPE_CHECKING:
    from odb.config import ODBConfig

_OVERSIZE = ("error", "alone", "skip")
_LOSS_SCALING = ("exact", "approx", "sample", "none")
_LAYOUTS = ("padded", "packed")
AUTO = "auto"  # token_budget="auto": the loader sets the budget from measured steps (odb.plan.auto.auto_budget)


def _fail(name: str, value: Any, rule: str, fix: str, exc: type = ValueError) -> None:
    raise exc(f"ODBConfig.{name}={value!r}: {rule}. Fix: {fix}.")


def _check_int(name: str, value: Any, minimum: int, fix: str, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, value, f"must be an int{' or None' if optional else ''}", fix, TypeError)
    if value < minimum:
        _fail(name, value, f"must be >= {minimum}", fix)


def validate(cfg: "ODBConfig") -> None:
    """Check every option of ``cfg`` (raises ValueError or TypeError with the fix)."""
    _check_auto(cfg)
    budgets = (cfg.auto_start_budget or 1,) if cfg.auto else \
        cfg.token_budget if isinstance(cfg.token_budget, tuple) else (cfg.token_budget,)
    if not budgets:
        _fail("token_budget", cfg.token_budget, "must not be empty", "pass e.g. token_budget=16384")
    for b in budgets:
        _check_int("token_budget", b, 1, "pass a positive number of tokens, e.g. token_budget=16384")
    _check_int("window_budgets", cfg.window_budgets, 1,
               "pass None (windows in samples) or a number of budgets, e.g. 64", optional=True)
    _check_int("buffer_size", cfg.buffer_size, 1, "use a window of a few hundred samples or more, e.g. 1024")
    _check_int("first_window_size", cfg.first_window_size, 1, "pass e.g. 64, or buffer_size for no ramp")
    _check_int("max_carry", cfg.max_carry, 0, "pass None (a full window) or a count >= 0", optional=True)
    if cfg.pack_efficiency is not None:
        if isinstance(cfg.pack_efficiency, bool) or not isinstance(cfg.pack_efficiency, (int, float)):
            _fail("pack_efficiency", cfg.pack_efficiency, "must be a float or None", "pass e.g. 0.95",
                  TypeError)
        if not 0.0 < cfg.pack_efficiency <= 1.0 or math.isnan(cfg.pack_efficiency):
            _fail("pack_efficiency", cfg.pack_efficiency, "must be in (0, 1]", "pass e.g. 0.95")
    _check_int("pad_to_multiple_of", cfg.pad_to_multiple_of, 1, "pass 1 (no rounding) or e.g. 8")
    _check_int("max_batch_size", cfg.max_batch_size, 1, "pass None (no cap) or a positive count", optional=True)
    _check_int("batch_size_multiple", cfg.batch_size_multiple, 1, "pass 1 (any size) or e.g. 8")
    if cfg.max_batch_size is not None and cfg.max_batch_size < cfg.batch_size_multiple:
        _fail("max_batch_size", cfg.max_batch_size,
              f"must be >= batch_size_multiple={cfg.batch_size_multiple}",
              "raise max_batch_size or lower batch_size_multiple")
    _check_shape_buckets(cfg)
    _check_int("quadratic_length", cfg.quadratic_length, 1, "pass None or a length such as 4096", optional=True)
    for name in ("length_fn", "loss_tokens_fn"):
        fn = getattr(cfg, name)
        if fn is not None and not callable(fn):
            _fail(name, fn, "must be callable", "pass a function sample -> int", TypeError)
    if cfg.image_patches_key is not None and (not isinstance(cfg.image_patches_key, str)
                                               or not cfg.image_patches_key):
        _fail("image_patches_key", cfg.image_patches_key, "must be a non-empty str or None",
              "pass the sample field holding the patch count, e.g. 'num_image_patches'", TypeError)
    _check_int("max_image_patches", cfg.max_image_patches, 1, "pass None or a positive count", optional=True)
    if (cfg.image_patches_key is None) != (cfg.max_image_patches is None):
        _fail("max_image_patches", cfg.max_image_patches,
              "must be given together with image_patches_key",
              "set both image_patches_key and max_image_patches, or neither")
    if cfg.oversize not in _OVERSIZE:
        _fail("oversize", cfg.oversize, f"must be one of {_OVERSIZE}", 'use "error", "alone" or "skip"')
    _check_int("seed", cfg.seed, 0, "pass None or a non-negative int", optional=True)
    if cfg.loss_scaling not in _LOSS_SCALING:
        _fail("loss_scaling", cfg.loss_scaling, f"must be one of {_LOSS_SCALING}", 'use "exact" (default)')
    _check_int("gradient_accumulation_steps", cfg.gradient_accumulation_steps, 1,
               "pass the trainer's accumulation steps, 1 or more")
    _check_global_batch(cfg)
    if isinstance(cfg.exchange_timeout_s, bool) or not isinstance(cfg.exchange_timeout_s, (int, float)):
        _fail("exchange_timeout_s", cfg.exchange_timeout_s, "must be a number of seconds", "pass e.g. 1800",
              TypeError)
    if not cfg.exchange_timeout_s > 0:
        _fail("exchange_timeout_s", cfg.exchange_timeout_s, "must be > 0",
              "pass minutes' worth of seconds, e.g. 1800")
    _check_int("transfer_chunk_size", cfg.transfer_chunk_size, 1, "pass e.g. 16")
    if not isinstance(cfg.join, bool):
        _fail("join", cfg.join, "must be a bool", "pass True or False", TypeError)
    if cfg.shift_labels is not None and not isinstance(cfg.shift_labels, bool):
        _fail("shift_labels", cfg.shift_labels, "must be a bool or None",
              "pass True (causal LM) or False (every label counts)", TypeError)
    _check_int("ignore_index", cfg.ignore_index, -(2**62), "pass an int such as -100")
    if cfg.budget_schedule is not None:
        from odb.plan.costs.schedule import check_schedule

        if isinstance(cfg.token_budget, tuple):
            _fail("budget_schedule", cfg.budget_schedule, "needs an int token_budget, not per-dimension budgets",
                  "use one summed budget, or no schedule")
        object.__setattr__(cfg, "budget_schedule", check_schedule(cfg.budget_schedule))
    _check_int("ready_batches", cfg.ready_batches, 0, "pass e.g. 4, or 0 to work on the training thread")
    _check_layout(cfg)
    _check_context_parallel(cfg)
    if not isinstance(cfg.probe_worst_case, bool):
        _fail("probe_worst_case", cfg.probe_worst_case, "must be a bool", "pass True or False", TypeError)
    if not isinstance(cfg.distributed, bool):
        _fail("distributed", cfg.distributed, "must be a bool",
              "pass True (align ranks under torch.distributed) or False (a loader of this process only)",
              TypeError)
    for name in ("label_key", "step_info_key"):
        if not isinstance(getattr(cfg, name), str) or not getattr(cfg, name):
            _fail(name, getattr(cfg, name), "must be a non-empty str", "pass a field name", TypeError)

def _check_auto(cfg: "ODBConfig") -> None:
    """The options of ``token_budget="auto"`` (and ``sample_cost``, ``balance``, usable without it)."""
    for name, per, example in (("sample_cost", "sample", "16.0"), ("image_patch_cost", "image patch", "0.25"),
                               ("loss_token_cost", "supervised token", "2.0")):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            _fail(name, value, f"must be a finite number >= 0 (tokens-equivalent per {per})",
                  f"pass 0.0 (none) or e.g. {example}")
    if cfg.image_patch_cost and cfg.image_patches_key is None:
        _fail("image_patch_cost", cfg.image_patch_cost, "prices image patches, which odb reads from "
              "image_patches_key (None here)", "set image_patches_key (and max_image_patches), or "
              "image_patch_cost=0.0")
    from odb.plan.ranks.pairing import PAIRINGS

    if cfg.balance not in PAIRINGS:
        _fail("balance", cfg.balance, f"must be one of {tuple(PAIRINGS)}",
              'use "tokens" (default) or "time" (or register a criterion: odb.plan.ranks.pairing.register_pairing)')
    if isinstance(cfg.token_budget, str) and cfg.token_budget != AUTO:
        _fail("token_budget", cfg.token_budget, 'must be an int, a tuple of ints or "auto"',
              'pass e.g. token_budget=16384, or token_budget="auto" with a memory cap', TypeError)
    _check_int("memory_cap_bytes", cfg.memory_cap_bytes, 1, "pass None or the bytes a step may use",
               optional=True)
    _check_int("auto_start_budget", cfg.auto_start_budget, 1,
               "pass None (twice the first window's longest sample) or a number of tokens", optional=True)
    for name, low, high in (("memory_fraction", 0.0, 1.0), ("auto_margin", 0.0, 0.9)):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
            _fail(name, value, f"must be a number in ({low}, {high}]", f"pass e.g. {name}="
                  f"{0.9 if name == 'memory_fraction' else 0.1}")
    if cfg.memory_meter is not None and not callable(cfg.memory_meter):
        _fail("memory_meter", cfg.memory_meter, "must be callable: meter() -> peak bytes since its last call",
              "pass e.g. odb.train.memory.ActivationMeter(model)", TypeError)
    if not cfg.auto:
        if cfg.balance == "time":
            _fail("balance", cfg.balance, 'needs token_budget="auto" (the step-time model is fitted there)',
                  'pass token_budget="auto", or leave balance="tokens"')
        return
    if cfg.budget_schedule is not None:
        _fail("budget_schedule", cfg.budget_schedule, 'must be None with token_budget="auto" (the loader sets '
              "the budget from measured steps)", "drop budget_schedule, or pass an int token_budget")
    if cfg.shape_buckets is not None:
        _fail("shape_buckets", cfg.shape_buckets, 'must be None with token_budget="auto" (the buckets are cut '
              "from a fixed budget)", "drop shape_buckets, or pass an int token_budget")
    cuda = _cuda_available()
    if cfg.memory_cap_bytes is None and not cuda:
        _fail("token_budget", cfg.token_budget, "needs a memory cap: memory_cap_bytes, or memory_fraction of a "
              "CUDA device (none is available here)", "pass memory_cap_bytes=<bytes a step may use>")
    if cfg.memory_meter is None and not cuda:
        _fail("token_budget", cfg.token_budget, "needs a memory meter: CUDA's allocator peak is the default, and "
              "no CUDA device is available here", "pass memory_meter=odb.train.memory.ActivationMeter(model)")

def _check_global_batch(cfg: "ODBConfig") -> None:
    """``global_batch_size``: a count of samples; the micro-batch count is then planned per step."""
    _check_int("global_batch_size", cfg.global_batch_size, 1,
               "pass None (budget-filled steps) or the samples of one optimizer step, all ranks together "
               "(batch_size x accumulation x world size), e.g. 64", optional=True)
    cost = cfg.micro_batch_cost
    if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float)) or
                             not math.isfinite(cost) or cost < 0):
        _fail("micro_batch_cost", cost, "must be None or a finite number >= 0 (tokens per micro-batch)",
              "pass None (a sixteenth of the budget) or e.g. 256.0")
    if cfg.step_plan not in ("global", "rank"):
        _fail("step_plan", cfg.step_plan, 'must be "global" (a step planned across ranks) or "rank" (each rank '
              "plans its own share)", 'pass step_plan="global" (the default) or "rank"')
    if cfg.composition not in COMPOSITIONS:
        _fail("composition", cfg.composition, f"names no step composition ({sorted(COMPOSITIONS)})",
              'pass composition="sampler" (the default: your sampler\'s steps) or "length_grouped", or register '
              "yours with odb.plan.steps.composition.register_composition first")
    _check_int("composition_block_steps", cfg.composition_block_steps, 1,
               "pass the optimizer steps composed together, e.g. 16")
    _check_int("composition_warmup_steps", cfg.composition_warmup_steps, 0,
               "pass 0 (no warm-up) or the optimizer steps of a short-to-long warm-up")
    if cfg.global_batch_size is not None and cfg.gradient_accumulation_steps != 1:
        _fail("gradient_accumulation_steps", cfg.gradient_accumulation_steps,
              f"must be 1 with global_batch_size={cfg.global_batch_size}: odb then plans each optimizer "
              f"step's micro-batches itself, as many as its samples need under token_budget",
              "drop gradient_accumulation_steps and fold the accumulation into global_batch_size (batch_size "
              "x accumulation x world size), or pass global_batch_size=None for budget-filled steps of "
              "gradient_accumulation_steps micro-batches")

def _check_shape_buckets(cfg: "ODBConfig") -> None:
    value = cfg.shape_buckets
    if value is None:
        return
    if cfg.layout == "packed":
        _fail("shape_buckets", value, 'must be None with layout="packed": it pads the rows of padded batches to '
              "a few lengths, and a packed batch is one row without padding",
              'leave shape_buckets=None, or use layout="padded"')
    fix = ("pass an int such as 8 (lengths halving from the budget), a tuple of increasing lengths such as "
           "odb.geometric_buckets(128, 2048, 6), or None")
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, tuple, list)):
        _fail("shape_buckets", value, "must be None, an int or a tuple of ints", fix, TypeError)
    if isinstance(value, numbers.Integral):
        if value < 2:
            _fail("shape_buckets", value, "must be >= 2 (one bucket pads every batch to the budget)", fix)
        from odb.plan.costs.buckets import halving_buckets

        budgets = list(cfg.token_budgets) + [int(b) for _, b in cfg.budget_schedule or ()]
        object.__setattr__(cfg, "shape_buckets", halving_buckets(max(budgets), int(value), cfg.pad_to_multiple_of))
        return
    if not value:
        _fail("shape_buckets", value, "must not be empty", fix)
    for v in value:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            _fail("shape_buckets", value, f"must hold ints, not {v!r}", fix, TypeError)
        if v < 1:
            _fail("shape_buckets", value, f"must hold positive lengths, not {v}", fix)
        if v % cfg.pad_to_multiple_of:
            _fail("shape_buckets", value, f"must hold multiples of pad_to_multiple_of={cfg.pad_to_multiple_of} "
                  f"(a batch padded to a multiple would miss the bucket), not {v}",
                  f"round each length up to a multiple of {cfg.pad_to_multiple_of}, e.g. "
                  f"odb.geometric_buckets(..., multiple={cfg.pad_to_multiple_of})")
    if any(b <= a for a, b in zip(value, value[1:])):
        _fail("shape_buckets", value, "must be strictly increasing", "sort the lengths and drop repeats")
    if value[0] > max(cfg.token_budgets):
        _fail("shape_buckets", value, f"starts at {value[0]}, above token_budget={cfg.token_budget}: no batch "
              f"can take any of these lengths", f"use lengths up to the budget, e.g. "
              f"shape_buckets={max(2, len(value))} (the budget halved {max(1, len(value) - 1)} times)")
    object.__setattr__(cfg, "shape_buckets", tuple(int(v) for v in value))

def _check_layout(cfg: "ODBConfig") -> None:
    if cfg.layout not in _LAYOUTS:
        _fail("layout", cfg.layout, f"must be one of {_LAYOUTS}", 'use "padded" (default) or "packed"')
    if cfg.layout != "packed":
        return
    if isinstance(cfg.token_budget, tuple):
        _fail("token_budget", cfg.token_budget, 'must be one int with layout="packed": a packed batch is one '
              "row, whose length the budget bounds", 'pass token_budget=<int>, or layout="padded" for '
              "per-dimension budgets")
    for name, what in (("pad_to_multiple_of", "pads each sample of a padded batch"),
                       ("batch_size_multiple", "shapes the batch dimension of padded batches")):
        if getattr(cfg, name) != 1:
            _fail(name, getattr(cfg, name), f'must be 1 with layout="packed": it {what}, and a packed batch is '
                  "one row without padding", f'leave {name}=1, or use layout="padded"')



def _check_context_parallel(cfg: "ODBConfig") -> None:
    _check_int("context_parallel", cfg.context_parallel, 1,
               "pass the context parallel degree of each replica (1: none), or a device_mesh with a 'cp' dimension")
    _check_int("context_parallel_multiple", cfg.context_parallel_multiple, 1,
               "pass None (2 x context_parallel) or the multiple your CP sharding needs", optional=True)
    if not isinstance(cfg.check_peers, bool):
        _fail("check_peers", cfg.check_peers, "must be a bool", "pass True (digest every batch) or False", TypeError)
    if cfg.context_parallel > 1 and cfg.shape_buckets is not None:
        bad = [b for b in cfg.shape_buckets if b % cfg.length_multiple] if isinstance(cfg.shape_buckets, tuple) else []
        if bad:
            _fail("shape_buckets", cfg.shape_buckets, f"must be multiples of {cfg.length_multiple} under "
                  f"context_parallel={cfg.context_parallel} (its sharding splits every sequence evenly); "
                  f"{bad} are not", f"use multiples of {cfg.length_multiple}")


def _cuda_available() -> bool:
    """Whether torch sees a CUDA device (False without torch: odb.config imports no torch)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch  # type: ignore[no-redef]
        except ImportError:
            return False
    return bool(torch.cuda.is_available())


def check_composition(cfg: "ODBConfig") -> None:
    """Refuse a step composition without the user's batch (the loader calls it once its batch is resolved)."""
    if cfg.composition != "sampler" and cfg.global_batch_size is None:
        _fail("composition", cfg.composition, "composes the optimizer steps of your batch (global_batch_size), and "
              "budget-filled steps (global_batch_size=None) are windows odb already groups by length",
              "pass your batch (ODBDataLoader(batch_size=B), or global_batch_size=), or drop composition")
