"""ODBConfig: every option of odb in one frozen dataclass, validated when made (odb.config_rules)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Literal, Optional, Sequence, Tuple, Union

from odb.arguments import check_options
from odb.config_rules import AUTO, validate

OversizePolicy = Literal["error", "alone", "skip"]
LossScaling = Literal["exact", "approx", "sample", "none"]
Layout = Literal["padded", "packed"]
Balance = Literal["tokens", "time"]
StepPlanner = Literal["global", "rank"]

@dataclasses.dataclass(frozen=True)
class ODBConfig:
    """All options of online dynamic batching.

    Example:
        >>> cfg = ODBConfig(token_budget=16384, buffer_size=1024, pad_to_multiple_of=8)
        >>> cfg.token_budgets
        (16384,)

    Attributes:
        token_budget: the most a batch may cost. A batch of B samples whose longest
            padded sample has length L costs B x L. An int budgets the sum over all
            length dimensions; a tuple gives one budget per dimension (e.g. source
            and target of an encoder-decoder pair). ``"auto"``: the loader measures every
            step's peak memory (``memory_meter``) and seconds, fits a model of them from
            the batches' shapes, and plans each window under the largest budget whose
            predicted peak stays under the memory cap (``memory_cap_bytes`` or
            ``memory_fraction``) with ``auto_margin`` to spare (odb.plan.auto.auto_budget;
            docs/options.md). One length dimension; no ``shape_buckets``, no
            ``budget_schedule``, no ``lengths=`` (known lengths).
        window_budgets: a planning window closes once it holds this many budgets'
            worth of real tokens (``window_budgets x sum(token_budget)``), so short and
            long samples alike see many batches' worth per window. None: windows are
            counted in samples only (``buffer_size``).
        buffer_size: the most processed samples in one planning window (a cap on the
            token-sized window, set so that 64 budgets of 16,384 tokens of short pairs
            of ~36 tokens still fit; the window size itself when window_budgets is None).
        first_window_size: the first window of an epoch holds at most this many samples
            and each next one 1.5 times as many, up to the full window, so the first batch
            does not wait for a full window (set it to buffer_size to disable the ramp).
        max_carry: the most samples carried from one window to the next (samples
            that did not fit a well-packed batch yet). Default: a full window's samples.
        pack_efficiency: a batch is emitted from a window (rather than carried) when
            its real tokens reach this share of a full batch of copies of its longest
            sample. Lower values emit sooner and pad more. In the packed layout: a row is
            emitted when its cost reaches this share of the budget. None (default): 0.99
            in the padded layout (a window that would emit less than 55% of its new samples
            adds its best carried batches that reach 0.95, so the loop does not wait), 0.95
            in the packed one; 1.0 with ``shape_buckets`` (where a sample counts as its bucket's
            length, so only full batches of one bucket are emitted).
        pad_to_multiple_of: padded lengths are rounded up to a multiple of this.
        max_batch_size: the most samples per batch (None: no limit).
        batch_size_multiple: batch sizes are a multiple of this whenever the budget
            allows that many samples and that many remain in the window.
        shape_buckets: bound the batch shapes a compiled model sees (torch.compile with
            ``dynamic=False``, CUDA graphs, backends that need static shapes; docs/compile.md).
            None (default): a batch is padded to its longest sample, and nearly every batch has
            its own (B, L). A tuple of increasing lengths (multiples of ``pad_to_multiple_of``):
            each batch's padded length L is the smallest of them that holds its longest sample,
            and its cost is B x that L. An int n: n lengths halving from the budget (the largest
            scheduled one with ``budget_schedule``), rounded down to ``pad_to_multiple_of``
            (16384 and 8 give 128, 256, ..., 16384); kept as that tuple. Batches are emitted
            full: B is what fits the budget at that L (capped by ``max_batch_size``, a multiple
            of ``batch_size_multiple``), so each bucket has one shape, apart from the first batch
            of an epoch, its last one and batches cut to align DDP ranks at an epoch's end.
            Every length dimension is bucketed on its own. A sample longer than the largest
            bucket, or whose bucket exceeds the budget, is oversize (see ``oversize``). The
            loader pads each collated dict batch on to its bucket (``odb.PadToBucket``:
            ``labels`` with ``ignore_index``, ``input_ids`` with the collator's pad token,
            other sequence tensors with 0); a collate_fn returning another type pads to
            ``odb.bucket_length(width, cfg.shape_buckets)`` itself. Padding to a bucket costs
            tokens (a ratio r between neighbouring buckets, up to 1 - 1/r of a batch):
            ``ODBStepInfo.padded_tokens`` and the epoch's token efficiency count it;
            ``odb.geometric_buckets`` and ``odb.fit_buckets`` build finer grids for a known
            range of lengths. Padded layout only.
        length_fn: ``length_fn(sample) -> int | tuple[int, ...]``; default reads
            ``input_ids`` (see ``odb.data.lengths.default_length``).
        quadratic_length: when set, each padded token costs ``1 + L / quadratic_length``
            (attention grows with L^2; as lhotse's quadratic duration).
        image_patches_key: sample field holding the number of image patches.
        max_image_patches: cap on the sum of image patches in one batch.
        image_patch_cost: what one image patch costs, in tokens-equivalent (default 0: patches bound
            only by ``max_image_patches``): a batch's cost adds the sum of its samples' patches times
            this, so one budget plans the language model's tokens and the vision tower's patches
            together. Needs ``image_patches_key``. ``token_budget="auto"`` sets it from its fit. The
            weight is the model's (vision tower against language model): 0.57 (plain loss) to 0.70
            (chunked loss) for Qwen2-VL-2B's shapes, measured by scripts/measure_patch_cost.py; no one
            value fits every model, hence 0 by default (docs/cost-model.md).
        loss_token_cost: what one supervised token (label != ``ignore_index``) costs beyond its
            token, in tokens-equivalent (default 0): for a chunked or fused loss, whose logits exist
            for supervised tokens only (memory ~ vocabulary x bytes each). ``token_budget="auto"``
            sets it from its fit. See docs/cost-model.md.
        oversize: what to do with one sample that alone costs more than the budget:
            "error" (default), "alone" (its own batch) or "skip" (counted, warned).
        seed: seed of shuffling and batch order; None takes the DataLoader's
            ``generator``'s, else the sampler's own ``seed`` (DistributedSampler,
            odb.ShardSampler), else draws one from torch's global RNG when the loader is built.
        loss_scaling: "exact", "approx", "sample" or "none" (see docs/algorithm.md).
        label_key: the sample field with labels, for loss tokens.
        ignore_index: label value that is not supervised.
        shift_labels: True: count each sample's labels[1:], as HF causal LMs do (their loss shifts
            the labels, so a row's first label is never predicted); set it for a causal LM. False:
            count every label (encoder-decoder and token-classification models). None (default):
            count every label, and warn once when the first batch's labels repeat its input_ids
            at every supervised position (a causal LM's unshifted labels), naming the fix.
        loss_tokens_fn: ``fn(sample) -> int``, overrides the label count.
        micro_batch_cost: with ``global_batch_size``: the fixed cost of one micro-batch in tokens (what a
            forward and backward pass costs beyond its tokens: kernel launches, a pass over the weights).
            A step's samples are cut into the micro-batches that minimise the sum of their costs (B x L
            padded) plus this each: 0 cuts into many small batches of similar lengths (least padding),
            a large value fills each micro-batch to the budget (fewest micro-batches). None (default): a
            sixteenth of the budget. Raise it for a model whose steps are launch-bound (a small model on
            a GPU), lower it where compute follows tokens (a large model, or a CPU).
        gradient_accumulation_steps: your accumulation A. With your batch (``ODBDataLoader(batch_size=B)``,
            or the batch_size of the loader ``odb.apply`` converts) it folds into ``global_batch_size = B x A x
            world size``; with budget-filled steps (``global_batch_size=None``), the micro-batches per optimizer
            step, for the denominator of exact loss scaling.
        global_batch_size: samples per optimizer step, all ranks together (the user's
            ``batch_size x accumulation x world size``; set for you from ``ODBDataLoader(batch_size=B)``,
            ``odb.apply``'s loader and the integrations' ``TrainingArguments``). Each optimizer step then holds exactly the
            next ``global_batch_size / world_size`` samples of each rank's sampler order (what a plain
            DataLoader loop with that accumulation would give it), split into as many micro-batches
            under ``token_budget`` as they need; every rank runs the same number of micro-batches in
            each step, ``ODBStepInfo.is_last_micro_step`` marks the step's end and ``loss_scale`` is
            exact over the whole step. An epoch's last step may hold fewer; ``drop_last`` drops only each
            rank's partial last batch of your ``batch_size`` (the whole partial step where no batch size is given).
            Windows, carry and the ramp do not apply: each step is planned on its own, cut into the
            micro-batches of least total cost (``micro_batch_cost``); under several ranks the step's samples
            are planned across ranks (``step_plan``). None (default):
            budget-filled steps, ``gradient_accumulation_steps`` micro-batches filled to the budget
            each (fewer, larger optimizer steps than a fixed batch size gives: docs/algorithm.md).
        step_plan: with ``global_batch_size`` under several ranks, who plans a step's micro-batches.
            "global" (default): the step's samples of every rank (their lengths exchanged, a few integers
            each) are planned together and dealt to ranks and micro-batches so that the slowest rank
            costs least (the slowest rank sets a DDP step's time, and FSDP meets at every micro-step);
            ranks may then hold different numbers of samples. With known ``lengths=`` each rank loads
            its own planned indices; otherwise processed samples move between ranks through
            torch.distributed (docs/distributed.md says what it costs). "rank": each rank cuts only its
            own ``global_batch_size / world_size`` samples (no sample crosses ranks).
        composition: with ``global_batch_size``, which samples form each optimizer step
            (odb.plan.steps.composition). "sampler" (default): the sampler's order, the steps your own loader
            gives (any sampler, e.g. transformers' ``LengthGroupedSampler``, keeps its steps exactly).
            "length_grouped": each step made of length-similar samples of a block of
            ``composition_block_steps`` steps, the block's steps in a shuffled order (the same on every
            rank), so adjacent steps' lengths do not follow each other; it changes which samples share a
            step, as group_by_length does (docs/algorithm.md). A name registered with
            ``odb.plan.steps.composition.register_composition`` is accepted too.
        composition_block_steps: optimizer steps whose samples a composition reads and composes
            together (each rank holds their samples meanwhile); more steps make them more alike.
        composition_warmup_steps: the first optimizer steps of the run (epoch 0) that
            ``composition="length_grouped"`` runs from short to long samples (a sequence-length
            warm-up); 0 (default): none.
        join: keep finished ranks in the exchange and emit ghost batches until all
            ranks are done (True), or stop a rank when its data ends (False).
        exchange_timeout_s: how long a rank waits for the others in one exchange.
        transfer_chunk_size: processed samples per message from a worker.
        step_info_key: key (dict batches) or attribute under which ODBStepInfo rides.
        budget_schedule: ``((optimizer_step, token_budget), ...)`` from step 0: the budget
            in force from each step on (e.g. ``odb.linear_budget_ramp``), applied per
            planning window; an int token_budget only.
        probe_worst_case: the first window of an epoch is a full buffer and its batch with
            the longest samples is emitted first, so an out-of-memory error shows up
            in the first step rather than hours later.
        ready_batches: batches a background thread plans, collates and pins ahead of the
            training loop (while the workers read the next window). 0 runs everything on
            the training thread, reading on demand (for debugging).
        layout: "padded" (default): a batch is B rows padded to its longest sample and
            costs B x L. "packed": a batch is one padding-free row (the samples end to
            end, ``position_ids`` restarting at each sample; ``odb.PackedCollate``), costs
            the sum of its samples' lengths (+ L^2 / quadratic_length each), and the
            planner packs rows close to the budget. See docs/packing.md.
        distributed: True (default): under torch.distributed the loader aligns its steps
            with the other ranks (docs/distributed.md). False: the loader stays on this
            process (evaluation or generation on rank 0 only): no group, no exchange; give
            it a sampler that does not shard.
        sample_cost: a fixed cost per sample in tokens-equivalent (default 0): a padded batch
            costs B x (L + sample_cost), a packed row the sum of (L + sample_cost); for models
            whose per-sample work (heads, a per-sample loss) matters next to their tokens.
            With ``token_budget="auto"`` the fitted memory model sets it (this value is the start).
        memory_cap_bytes: ``token_budget="auto"``: the peak memory a step may reach, in bytes
            (as ``memory_meter`` measures it). None: ``memory_fraction`` of the CUDA device's
            total memory (required without CUDA).
        memory_fraction: ``token_budget="auto"`` without ``memory_cap_bytes``: the cap as a share
            of the current CUDA device's total memory (default 0.9).
        memory_meter: ``token_budget="auto"``: ``meter() -> peak bytes (or None)`` since its
            last call, then reset. None: CUDA's allocator peak (``odb.train.memory.CudaPeakMeter``)
            when CUDA is available; required without CUDA (e.g.
            ``odb.train.memory.ActivationMeter(model)``).
        auto_start_budget: ``token_budget="auto"``: the budget of the first windows, until the
            memory model is fitted. None: twice the longest sample of the first window read
            (under several ranks each rank's own until the first exchange agrees: pass it to have
            every window agree from the first).
        auto_margin: ``token_budget="auto"``: the share of the cap kept free (default 0.1).
        balance: how ranks pair their batches in a step (several ranks): "tokens" (default: by
            the planner's cost) or "time" (by predicted step seconds, once the step-time model is
            fitted; needs ``token_budget="auto"``), or a criterion registered with
            ``odb.plan.ranks.pairing.register_pairing``. Under the global step plan the micro-batches the
            cost model cut are dealt to ranks by the criterion's price.
        context_parallel: the context (or sequence) parallel degree cp of each data-parallel replica: a
            micro-batch's sequences are split over cp ranks, so a micro-batch of T tokens costs T / cp on
            each (``token_budget`` stays a per-GPU budget: odb plans replica micro-batches under cp x it).
            Set for you from a ``device_mesh`` with a "cp" dimension (docs/distributed.md, "Meshes").
        context_parallel_multiple: with ``context_parallel`` above 1, every sample's length is padded to a
            multiple of this (on top of ``pad_to_multiple_of``): what the CP sharding needs to split each
            sequence evenly. None (default): 2 x context_parallel, as load-balanced causal CP (torch's
            ``context_parallel``, Megatron) cuts a sequence into 2 x cp chunks; pass cp for a sharding
            without load balancing (e.g. DeepSpeed-Ulysses sequence parallelism).
        check_peers: under a mesh (``device_mesh``, or ``process_group`` with ``peer_group``): every
            optimizer step's exchange also carries a digest of each micro-batch (its samples, shapes and
            step info), and every rank raises ``odb.comm.protocol.ODBPeerMismatch``, naming the two ranks,
            as soon as two peers of a replica would train different batches. A debugging aid (it hashes
            every batch); the peers' plan messages are compared in every mode.
    """

    token_budget: Union[int, Tuple[int, ...], Literal["auto"]]
    window_budgets: Optional[int] = 64
    buffer_size: int = 32768
    first_window_size: int = 64
    max_carry: Optional[int] = None
    pack_efficiency: Optional[float] = None
    pad_to_multiple_of: int = 1
    max_batch_size: Optional[int] = None
    batch_size_multiple: int = 1
    shape_buckets: Union[None, int, Tuple[int, ...]] = None
    length_fn: Optional[Callable[[Any], Union[int, Sequence[int]]]] = None
    quadratic_length: Optional[int] = None
    image_patches_key: Optional[str] = None
    max_image_patches: Optional[int] = None
    oversize: OversizePolicy = "error"
    seed: Optional[int] = None
    loss_scaling: LossScaling = "exact"
    label_key: str = "labels"
    ignore_index: int = -100
    shift_labels: Optional[bool] = None
    loss_tokens_fn: Optional[Callable[[Any], int]] = None
    gradient_accumulation_steps: int = 1
    global_batch_size: Optional[int] = None
    micro_batch_cost: Optional[float] = None
    step_plan: StepPlanner = "global"
    composition: str = "sampler"
    composition_block_steps: int = 16
    composition_warmup_steps: int = 0
    join: bool = True
    exchange_timeout_s: float = 1800.0
    transfer_chunk_size: int = 16
    step_info_key: str = "odb_step_info"
    budget_schedule: Optional[Tuple[Tuple[int, int], ...]] = None
    probe_worst_case: bool = False
    ready_batches: int = 4
    layout: Layout = "padded"
    distributed: bool = True
    sample_cost: float = 0.0
    image_patch_cost: float = 0.0
    loss_token_cost: float = 0.0
    memory_cap_bytes: Optional[int] = None
    memory_fraction: float = 0.9
    memory_meter: Optional[Callable[[], Optional[float]]] = None
    auto_start_budget: Optional[int] = None
    auto_margin: float = 0.1
    balance: Balance = "tokens"
    context_parallel: int = 1
    context_parallel_multiple: Optional[int] = None
    check_peers: bool = False

    @property
    def auto(self) -> bool:
        """Whether the budget is ``"auto"`` (set by the loader from measured steps)."""
        return isinstance(self.token_budget, str) and self.token_budget == AUTO

    def __post_init__(self) -> None:
        validate(self)  # odb.config_rules: each option's rule, with the fix

    def step_samples(self, world_size: int) -> Optional[int]:
        """Samples of one optimizer step on each of ``world_size`` ranks (None: budget-filled steps).

        Example:
            >>> ODBConfig(token_budget=64, global_batch_size=32).step_samples(4)
            8
        """
        g = self.global_batch_size
        if g is None:
            return None
        if g < world_size or g % world_size:
            raise ValueError(f"ODBConfig.global_batch_size={g}: must be a multiple of the world size "
                             f"({world_size} ranks), so that every rank's share of an optimizer step is a whole "
                             f"number of samples. Fix: pass global_batch_size=batch_size x accumulation x "
                             f"{world_size}, e.g. {max(1, g // world_size) * world_size}.")
        return g // world_size

    def micro_steps_capacity(self, world_size: int) -> int:
        """The most micro-batches one optimizer step can hold (the size of per-step messages)."""
        g = self.step_samples(world_size)
        return self.gradient_accumulation_steps if g is None else g

    @property
    def token_budgets(self) -> Tuple[int, ...]:
        """The budget as a tuple: one entry (sum over dimensions) or one per dimension. ``"auto"``: the
        start budget (``auto_start_budget``, 1 when unset: the loader plans under a resolved copy)."""
        tb = self.token_budget
        if self.auto:
            return (self.auto_start_budget or 1,)
        return tb if isinstance(tb, tuple) else (tb,)

    @property
    def length_multiple(self) -> int:
        """What every padded length is a multiple of: ``pad_to_multiple_of``, and under context parallelism
        the multiple its sharding needs (``context_parallel_multiple``, default 2 x cp).

        Example:
            >>> ODBConfig(token_budget=64, pad_to_multiple_of=8, context_parallel=2).length_multiple
            8
            >>> ODBConfig(token_budget=64, pad_to_multiple_of=6, context_parallel=2).length_multiple
            12
        """
        if self.context_parallel == 1:
            return self.pad_to_multiple_of
        shard = self.context_parallel_multiple or 2 * self.context_parallel
        return self.pad_to_multiple_of * shard // math.gcd(self.pad_to_multiple_of, shard)

    def replica_budget(self, token_budget: Union[int, Tuple[int, ...]]) -> Union[int, Tuple[int, ...]]:
        """A per-GPU ``token_budget`` as the budget of one replica's micro-batch: cp x it (a micro-batch of
        T tokens costs T / cp on each of its context-parallel ranks).

        Example:
            >>> ODBConfig(token_budget=64, context_parallel=4).replica_budget(64)
            256
        """
        cp = self.context_parallel
        return tuple(int(v) * cp for v in token_budget) if isinstance(token_budget, tuple) else int(token_budget) * cp

    @property
    def window_tokens(self) -> Optional[int]:
        """Real tokens at which a window closes (None: windows are counted in samples)."""
        if self.window_budgets is None:
            return None
        return self.window_budgets * sum(self.token_budgets)

    @property
    def emit_efficiency(self) -> float:
        """``pack_efficiency``, or its layout's default: 0.99 padded, 0.95 packed.

        Padded batches emitted at 0.95 leave up to 5% padding in every batch; at 0.99, with a
        carry of up to a full window, odb's token efficiency is above length-grouped fixed
        batches' on full epochs (docs/algorithm.md). With the default, a window that would emit
        less than 55% of its new samples at 0.99 adds its best carried batches that reach 0.95
        (odb.plan.windows.window.FEED_SHARE).
        Packed rows reach 0.95 of the budget with nothing padded; waiting for fuller rows only
        holds samples back. With ``shape_buckets`` the planner counts each sample as its bucket's
        length, so 1.0 means a full batch of one bucket: the one shape that bucket has.
        """
        if self.pack_efficiency is not None:
            return float(self.pack_efficiency)
        if self.shape_buckets is not None:
            return 1.0
        return 0.95 if self.layout == "packed" else 0.99

    def carry_limit(self, window_samples: int) -> int:
        """The most samples carried out of a window that received ``window_samples`` new ones
        (default: as many: samples waiting for well-packed neighbours may fill a window)."""
        return window_samples if self.max_carry is None else self.max_carry

    def replace(self, **changes: Any) -> "ODBConfig":
        """A copy with some options changed (validated again)."""
        return dataclasses.replace(self, **changes)


CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(ODBConfig))
# Options that change which batches come out: every rank must share them (odb.comm.agreement), and a
# resume state saved under other values is refused (odb.resume.state).
PLAN_OPTIONS = ("token_budget", "window_budgets", "buffer_size", "first_window_size", "max_carry",
                "pack_efficiency", "pad_to_multiple_of", "max_batch_size", "batch_size_multiple", "shape_buckets",
                "quadratic_length",
                "max_image_patches", "oversize", "gradient_accumulation_steps", "global_batch_size", "micro_batch_cost",
                "step_plan", "composition", "composition_block_steps", "composition_warmup_steps", "join",
                "loss_scaling",
                "budget_schedule", "probe_worst_case", "layout", "sample_cost", "image_patch_cost", "loss_token_cost",
                "auto_start_budget", "auto_margin",
                "balance", "context_parallel", "context_parallel_multiple")


def _checked_init(init: Callable[..., None]) -> Callable[..., None]:
    # An unknown option gets the closest option name, not the dataclass's bare "unexpected keyword" TypeError.
    @functools.wraps(init)
    def __init__(self: ODBConfig, *args: Any, **kwargs: Any) -> None:
        check_options(kwargs, "ODBConfig", CONFIG_FIELDS, "ODBConfig has one field per odb option")
        init(self, *args, **kwargs)
    return __init__


ODBConfig.__init__ = _checked_init(ODBConfig.__init__)  # type: ignore[method-assign]
