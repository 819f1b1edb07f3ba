"""Hugging Face Accelerate: iterate an odb loader under ``accelerate.Accelerator``.

``accelerator.prepare`` rebuilds every torch ``DataLoader`` it receives around a batch
sampler that shards *batches* across processes. An odb loader already yields this
rank's own token-budget batches (its sampler shards the samples; odb aligns the step
counts), so rebuilding it would throw odb away. ``configure_accelerator`` wraps the
loader in an ``ODBAcceleratedLoader``: not a DataLoader, so ``prepare`` hands it back
unchanged, yet it moves batches to ``accelerator.device`` and tells Accelerate's
gradient accumulation where odb's optimizer steps end. ``accelerator.backward`` divides
the loss by ``gradient_accumulation_steps``; ``scale_loss`` multiplies by odb's
``loss_scale`` and undoes that division, so the gradient of each optimizer step is the
exact token mean over all ranks and micro-batches.

Example (run with ``accelerate launch`` or ``torchrun``)::

    import odb
    from accelerate import Accelerator
    from odb.integrations.accelerate import configure_accelerator, scale_loss

    accelerator = Accelerator(gradient_accumulation_steps=2)          # before the sampler
    loader = odb.ODBDataLoader(dataset, token_budget=16384, sampler=odb.ShardSampler(dataset),
                               gradient_accumulation_steps=2, collate_fn=collate_fn)
    loader = configure_accelerator(accelerator, loader)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # loader unchanged
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            with accelerator.accumulate(model):
                info = odb.pop_step_info(batch)
                accelerator.backward(scale_loss(accelerator, model(**batch).loss, info))
                optimizer.step()
                optimizer.zero_grad()
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterator, Optional

import torch
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState
from accelerate.utils import send_to_device

from odb.loader.dataloader import ODBLoaderMixin
from odb.train.loss import scale_loss as exact_scale
from odb.step_info import ODBStepInfo, attach_step_info, pop_step_info
from odb.integrations.checks import check_accumulation, check_odb_loader, check_sharding
from odb.integrations.states import gather_states, restore_rank_state

logger = logging.getLogger(__name__)

__all__ = ["ODBAcceleratedLoader", "configure_accelerator", "scale_loss", "skip_first_batches"]


class ODBAcceleratedLoader(DataLoaderStateMixin):
    """An odb loader as Accelerate sees it; build it with ``configure_accelerator``.

    Iterating it iterates ``loader`` (the odb loader) and, per batch, moves the batch to
    ``device`` (the step info stays on it) and sets ``end_of_dataloader`` at the last
    micro-batch of each of odb's optimizer steps: that is how ``accelerator.accumulate``
    learns to sync there and to restart its count, so the optimizer steps exactly where
    odb's steps end (also for an epoch's last, shorter window and after a resume).
    ``len()``, ``set_epoch`` and ``odb_stats`` are the odb loader's; ``state_dict`` holds
    every rank's odb state (Accelerate saves registered objects from the main process).
    """

    def __init__(self, loader: ODBLoaderMixin, device: Optional[torch.device] = None, *,
                 non_blocking: bool = False, skip_batches: int = 0) -> None:
        self.loader = loader
        self.device = device
        self.non_blocking = non_blocking
        self.skip_batches = int(skip_batches)
        self.gradient_state = GradientState()

    # ---- what Accelerate and training loops read -----------------------------------------
    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    @property
    def odb_stats(self) -> Dict[str, Any]:
        """The odb loader's counters of the current (or last) epoch on this rank."""
        return self.loader.odb_stats

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next iteration (odb's batch order and the sampler's shuffle)."""
        self.loader.set_epoch(epoch)

    def __len__(self) -> int:
        return max(len(self.loader) - self.skip_batches, 0)

    def state_dict(self) -> Dict[str, Any]:
        """Every rank's odb resume state (call on all ranks between batches, as ``save_state`` does).

        Accelerate writes a registered object's state from the main process only, so the
        ranks' states (each rank's odb loader has its own) are gathered into one list.
        """
        return {"odb_rank_states": gather_states(self.loader.state_dict(), self.loader)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Give the odb loader this rank's entry of ``state_dict()`` (``load_state`` calls it)."""
        restore_rank_state(self.loader, state.get("odb_rank_states") if isinstance(state, dict) else None,
                           "ODBAcceleratedLoader.load_state_dict")

    def __getattr__(self, name: str) -> Any:
        # Only reached for missing attributes: say why Accelerate's DataLoader helpers fail here.
        if name.startswith("__") or name in ("loader", "gradient_state"):
            raise AttributeError(name)
        raise AttributeError(
            f"ODBAcceleratedLoader has no attribute {name!r}: it is not a torch DataLoader, so Accelerate's "
            f"helpers that rebuild a DataLoader from its batch sampler (accelerator.skip_first_batches, "
            f"prepare_data_loader) would drop odb's batching. Fix: use odb.integrations.accelerate."
            f"skip_first_batches(loader, n), and reach the odb loader itself as `.loader`.")

    # ---- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        check_accumulation(self.loader, self.gradient_state.num_steps, "the Accelerator")
        key = self.loader.odb_config.step_info_key
        skip = self.skip_batches
        self.begin()
        try:
            for index, batch in enumerate(self.loader):
                if index < skip:  # deterministic plan: the skipped batches are the ones already trained on
                    continue
                info = pop_step_info(batch, key)  # a tuple batch would lose it in send_to_device
                if self.device is not None:
                    batch = send_to_device(batch, self.device, non_blocking=self.non_blocking)
                # accelerator.accumulate syncs at, and restarts its count after, the end of the data; odb
                # knows where each optimizer step ends (the epoch's last one may hold fewer micro-batches,
                # and a resumed run may start inside one), so every step's end is reported as such.
                self.end_of_dataloader = info.is_last_micro_step
                yield attach_step_info(batch, info, key)
        finally:
            self.end()


def configure_accelerator(accelerator: Any, loader: ODBLoaderMixin, *,
                          device_placement: Optional[bool] = None) -> ODBAcceleratedLoader:
    """Make an odb loader ready for ``accelerator`` (pass the result to ``prepare`` or iterate it).

    Checks that the loader plans the accelerator's ``gradient_accumulation_steps`` (with
    ``global_batch_size``, where odb plans each step's micro-batches, it sets the accelerator's
    ``gradient_accumulation_steps`` to the most micro-batches a step can hold, logged, so that
    ``accelerator.accumulate`` steps exactly where odb's steps end) and that,
    on several processes, its sampler does not shard for another number of processes
    (Accelerate will not shard it; a ``ShardSampler()`` built before ``Accelerator()`` sees
    one process). Batches go to ``accelerator.device`` unless
    ``device_placement=False`` (default: ``accelerator.device_placement``). The result is
    registered with ``accelerator.register_for_checkpointing``, so ``save_state`` /
    ``load_state`` resume it mid-epoch exactly.

    Example::

        loader = configure_accelerator(accelerator, odb.ODBDataLoader(ds, token_budget=8192,
                                                                      sampler=odb.ShardSampler(ds)))
    """
    check_odb_loader(loader, "configure_accelerator")
    check_accumulation(loader, accelerator.gradient_accumulation_steps, "the Accelerator")
    if getattr(accelerator, "dispatch_batches", None):
        raise ValueError("configure_accelerator got an Accelerator with dispatch_batches=True (the main process "
                         "loads every batch and slices it): odb loads and plans on every rank. Fix: "
                         "Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=False)).")
    replicas = check_mesh(accelerator, loader)
    check_sharding(loader, replicas, "build the loader after Accelerator() with "
                   "sampler=odb.ShardSampler(dataset) (or DistributedSampler(dataset)); under a ParallelismConfig, "
                   "with num_replicas and rank of the mesh's data-parallel dimensions.")
    capacity = loader.odb_config.micro_steps_capacity(replicas)
    if loader.odb_config.global_batch_size is not None and accelerator.gradient_accumulation_steps != capacity:
        # odb's steps hold up to `capacity` micro-batches: Accelerate must not sync (and step) before odb's step
        # ends, which end_of_dataloader tells it; scale_loss undoes backward's division by this count.
        logger.info("odb: global_batch_size=%d: Accelerator.gradient_accumulation_steps %d -> %d, so that "
                    "accelerator.accumulate steps at the end of each of odb's optimizer steps (their micro-batches "
                    "vary) and never inside one", loader.odb_config.global_batch_size,
                    accelerator.gradient_accumulation_steps, capacity)
        accelerator.gradient_accumulation_steps = capacity
    place = accelerator.device_placement if device_placement is None else device_placement
    wrapped = ODBAcceleratedLoader(loader, accelerator.device if place else None,
                                   non_blocking=bool(getattr(accelerator, "non_blocking", False)))
    accelerator.register_for_checkpointing(wrapped)
    return wrapped


def check_mesh(accelerator: Any, loader: ODBLoaderMixin) -> int:
    """The data-parallel replicas of ``accelerator`` (its processes, or its ParallelismConfig's dp_replicate x
    dp_shard). Under tensor parallelism the loader must plan over that mesh's replicas (``device_mesh=
    accelerator.torch_device_mesh``); context and sequence parallelism are refused, naming why."""
    config = getattr(accelerator, "parallelism_config", None)  # (accelerate >= 1.10)
    if config is None:
        return accelerator.num_processes
    sizes = {"context": config.cp_size, "sequence": config.sp_size}
    refused = [f"{kind} parallelism of size {size}" for kind, size in sizes.items() if size > 1]
    if refused:
        raise ValueError(
            f"configure_accelerator got an Accelerator with {' and '.join(refused)}: Accelerate shards each "
            f"sequence itself inside the model's forward (torch's context_parallel, DeepSpeed's Ulysses), and its "
            f"loss and gradient reduction over those shards are not what odb's loss_scale assumes; odb cannot test "
            f"it here (accelerate {_accelerate_version()} builds a ParallelismConfig only under FSDP2, DeepSpeed or "
            f"several GPUs) and refuses it rather than train unchecked. Fix: a loop of your own over "
            f"odb.ODBDataLoader(..., device_mesh=mesh) with odb.context_shard (docs/distributed.md, 'Meshes'), or "
            f"tensor and data parallelism only.")
    replicas = int(config.dp_replicate_size) * int(config.dp_shard_size)
    planned = loader.odb_core.world()[1]
    if config.tp_size > 1 and planned != replicas:
        raise ValueError(
            f"configure_accelerator got an Accelerator with tensor parallelism of size {config.tp_size} "
            f"({replicas} data-parallel replicas) and an odb loader that plans over {planned} ranks: the tensor "
            f"parallel peers of a replica would get different batches. Fix: build the loader after Accelerator() "
            f"with device_mesh=accelerator.torch_device_mesh and a sampler over the replicas (DistributedSampler("
            f"dataset, num_replicas={replicas}, rank=accelerator.torch_device_mesh['dp'].get_local_rank())). "
            f"(Untested on GPU: Accelerate builds a ParallelismConfig only there.)")
    return replicas


def _accelerate_version() -> str:
    import accelerate

    return accelerate.__version__


def scale_loss(accelerator: Any, loss: torch.Tensor, info: ODBStepInfo) -> torch.Tensor:
    """The loss to give ``accelerator.backward``: ``loss * info.loss_scale * gradient_accumulation_steps``.

    ``loss`` is the mean over this batch's supervised tokens. ``accelerator.backward``
    (and DeepSpeed's engine) divide by ``gradient_accumulation_steps``; odb's
    ``loss_scale`` already spreads the optimizer step's token mean over its micro-batches,
    so the factor cancels that division. A ghost batch, or one without supervised tokens
    (whose mean loss is 0 / 0 = NaN), gets an exact zero that still runs backward
    (``odb.scale_loss``).

    Example::

        accelerator.backward(scale_loss(accelerator, outputs.loss, info))
    """
    return exact_scale(loss, info, accelerator.gradient_accumulation_steps)


def skip_first_batches(loader: ODBAcceleratedLoader, num_batches: int) -> ODBAcceleratedLoader:
    """A view of ``loader`` whose next iteration skips its first ``num_batches`` batches (all ranks alike).

    odb's plan is a pure function of seed, epoch, data and world size, so the skipped
    batches are exactly those a run interrupted after ``num_batches`` batches had
    trained on; they are still loaded and planned (cost: reading them again). Use the
    view for the resumed epoch only, after ``loader.set_epoch(epoch)``; iterate
    ``loader`` itself afterwards. Accelerate's own ``skip_first_batches`` rebuilds a
    plain DataLoader and does not apply.

    Example::

        loader.set_epoch(resume_epoch)
        for batch in skip_first_batches(loader, resume_batch): ...
    """
    if not isinstance(loader, ODBAcceleratedLoader):
        raise TypeError(f"skip_first_batches got {type(loader).__name__}, not the ODBAcceleratedLoader that "
                        f"configure_accelerator returns. Fix: pass that object.")
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
        raise ValueError(f"skip_first_batches got num_batches={num_batches!r}: it must be an int >= 0. "
                         f"Fix: pass the number of batches the interrupted run had finished in this epoch.")
    return ODBAcceleratedLoader(loader.loader, loader.device, non_blocking=loader.non_blocking,
                                skip_batches=num_batches)
