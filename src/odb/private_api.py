"""Every name of torch, transformers and TRL that odb relies on beyond their documented API, in one place, checked.

odb's integrations override some of the transformers Trainer's loop methods, call a few of its
private helpers, stand in for one of TRL's private methods and read a few of TRL's private flags;
odb's core reads a few attributes of torch and transformers objects that have no public
equivalent (``CORE_NAMES``: a custom autograd node's Function, a tensor's version counter, a config's attention implementation). A release that
renames or reshapes one of them must stop odb loudly, never let it train wrong:

- ``check_classes`` (at ``enable_odb``): each method of ``NAMES`` exists on its owner class with
  the parameters odb passes or receives;
- ``check_instance`` (at ``enable_odb``, on the built trainer): each instance attribute of
  ``NAMES`` (TRL's private flags) and of ``TRL_SETTINGS`` (the public settings odb decides by)
  exists, with the type odb expects; odb then reads them without a default;
- ``StandIn`` (after each call odb makes): a method odb stands in for was really called by the
  framework's code (a renamed call would leave odb's stand-in unused, and the framework's own
  method would run on odb's layout).
- ``read`` (at each use of a ``CORE_NAMES`` entry): the object holds the name, of the type odb
  expects; never a default in its place.

Each failure raises ``FrameworkDrift``, naming the installed version, the missing or changed piece
and the fix: pin the tested range (``TESTED``).

Example:
    >>> [n.name for n in NAMES if n.role == "stand-in"]
    ['_get_per_token_logps_and_entropies', '_get_per_token_logps_and_entropies']
    >>> TESTED["trl"]
    'trl>=1.16,<1.17'
    >>> import torch
    >>> read(torch.zeros(1), "Tensor", "_version")
    0
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Tuple

__all__ = ["CORE_NAMES", "FrameworkDrift", "FrameworkName", "NAMES", "StandIn", "TESTED", "TRL_SETTINGS",
           "check_classes", "check_instance", "names_of", "read", "version_of"]

# The ranges the tests ran (docs/versions.md); the `trl` extra of pyproject.toml declares the same TRL range.
TESTED = {"trl": "trl>=1.16,<1.17", "transformers": "transformers>=5.18,<5.25", "torch": "torch>=2.6,<2.14"}
_MODULES = {"Trainer": "transformers.trainer", "GRPOTrainer": "trl.trainer.grpo_trainer",
            "RLOOTrainer": "trl.trainer.rloo_trainer"}


@dataclass(frozen=True)
class FrameworkName:
    """One name odb relies on: ``owner`` (the framework's class), ``kind`` ``"method"`` (checked on the class, with
    ``params``) or ``"attribute"`` (checked on the built trainer, of type ``types``), ``role`` (what odb does with it:
    ``"override"``, ``"call"``, ``"stand-in"``, ``"read"``, ``"rewrite"``, ``"wrap"``) and ``why``; ``library``: the
    framework (default: transformers for the Trainer's names, TRL for the rest)."""

    owner: str
    name: str
    kind: str
    role: str
    why: str
    params: Tuple[str, ...] = ()
    types: Tuple[type, ...] = ()
    library: str = ""

    @property
    def framework(self) -> str:
        return self.library or ("transformers" if self.owner == "Trainer" else "trl")


def _trainer(name: str, role: str, why: str, *params: str) -> FrameworkName:
    return FrameworkName("Trainer", name, "method", role, why, params)


_LOOP = "odb.integrations.hf's Trainer loop"
_RL = ("GRPOTrainer", "RLOOTrainer")
_FORWARD = ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
            "compute_aux_loss")
NAMES: Tuple[FrameworkName, ...] = (
    _trainer("_run_epoch", "override", f"{_LOOP}: one epoch over odb's loader", "epoch", "train_dataloader",
             "steps_in_epoch", "num_update_steps_per_epoch", "steps_trained_in_current_epoch"),
    _trainer("_init_training_state", "override", f"{_LOOP}: the loader state of a resumed checkpoint",
             "resume_from_checkpoint"),
    _trainer("get_batch_samples", "override", f"{_LOOP}: an optimizer step's micro-batches as odb planned them",
             "epoch_iterator"),
    _trainer("set_initial_training_values", "override", f"{_LOOP}: the step counts of odb's loader", "dataloader"),
    _trainer("_save_checkpoint", "override", f"{_LOOP}: every rank's loader state in the checkpoint", "model",
             "trial"),
    _trainer("_load_rng_state", "call", f"{_LOOP}: the RNG states of a resumed epoch", "checkpoint"),
    _trainer("_track_num_input_tokens", "override", f"{_LOOP}: input tokens of odb's micro-batches", "inputs"),
    _trainer("_remove_unused_columns", "call", "odb.integrations.hf.data: the columns the model takes", "dataset",
             "description"),
    _trainer("_get_collator_with_removed_columns", "call", "odb.integrations.hf.data: the collator that drops "
             "them", "data_collator", "description"),
    _trainer("_get_train_sampler", "call", "odb.integrations.hf.sampling: the Trainer's own sampler of "
             "group_by_length and batch_rebalance, whose steps odb keeps", "train_dataset"),
    _trainer("_get_output_dir", "call", f"{_LOOP}: where the checkpoint's loader states go", "trial"),
    *(FrameworkName(owner, "_compute_loss", "method", "read", "odb.integrations.trl.rl_loss: the loss odb cuts into "
                    "micro-batches (a subclass's own is refused)", ("model", "inputs")) for owner in _RL),
    *(FrameworkName(owner, "_get_per_token_logps_and_entropies", "method", "stand-in", "odb.integrations.trl."
                    "rl_forward: odb's rollout layout stands in for it inside odb's loss calls", _FORWARD)
      for owner in _RL),
    *(FrameworkName(owner, "_metrics", "attribute", "rewrite", "odb.integrations.trl.rl_metrics: TRL's metrics of "
                    "a slice, recombined from odb's micro-batches", types=(dict,)) for owner in _RL),
    *(FrameworkName(owner, "_is_vlm", "attribute", "read", "odb.integrations.trl.rl_loss: vision-language "
                    "rollouts are refused", types=(bool,)) for owner in _RL),
    FrameworkName("GRPOTrainer", "_entropy_bonus_enabled", "attribute", "read", "odb.integrations.trl.rl_loss: "
                  "the entropy bonus's own per-token normaliser", types=(bool,)),
)

# What odb's core reads of torch and transformers objects beyond their documented API, each through ``read``.
CORE_NAMES: Tuple[FrameworkName, ...] = (
    FrameworkName("autograd node of a custom Function", "_forward_cls", "attribute", "read", "odb.train.loss: the "
                  "Function of a node (a reentrant checkpoint runs its parameters in backward)", types=(type,),
                  library="torch"),
    FrameworkName("CheckpointFunction's node", "run_function", "method", "read", "odb.train.loss: the function a "
                  "reentrant checkpoint reruns in backward, whose parameters odb counts", library="torch"),
    FrameworkName("Tensor", "_version", "attribute", "read", "odb.train.oom: whether a gradient was written before "
                  "an out-of-memory error", types=(int,), library="torch"),
    FrameworkName("PretrainedConfig", "_attn_implementation", "attribute", "read", "odb.packed.models: the "
                  "attention a packed row runs through", types=(str, type(None)), library="transformers"),
    FrameworkName("BatchRebalanceSampler", "_assign", "method", "wrap", "odb.bench.scale: the seconds of each of "
                  "its step plans", library="transformers"),
)
_CORE = {(n.owner, n.name): n for n in CORE_NAMES}


def read(obj: Any, owner: str, name: str) -> Any:
    """``obj.<name>``, a ``CORE_NAMES`` entry of ``owner``, checked: ``FrameworkDrift`` when ``obj`` lacks it or it
    is not of the registered type (a method: not callable), naming the installed version and the fix.

    Example:
        >>> class Tensor:
        ...     _version = "3"
        >>> read(Tensor(), "Tensor", "_version")
        Traceback (most recent call last):
        ...
        odb.private_api.FrameworkDrift: odb relies on torch's Tensor._version, ...
    """
    entry = _CORE[(owner, name)]
    try:
        value = getattr(obj, name)
    except AttributeError:
        raise drift(entry.framework, _describe(entry), f"has no {owner}.{name} ({type(obj).__name__})") from None
    wrong = not callable(value) if entry.kind == "method" else bool(entry.types) and not isinstance(value, entry.types)
    if wrong:
        expected = "a callable" if entry.kind == "method" else " or ".join(t.__name__ for t in entry.types)
        raise drift(entry.framework, _describe(entry), f"has {owner}.{name} of type {type(value).__name__}, not "
                                                       f"{expected}")
    return value


# TRL's public settings (set on the trainer by its __init__) that odb decides by: read without a default once checked.
_NUMBER = (int, float)
_MAYBE_NUMBER = (int, float, type(None))
_COMMON = {"use_vllm": (bool,), "max_completion_length": (int,), "pad_to_multiple_of": (int, type(None)),
           "aux_loss_enabled": (bool,)}
TRL_SETTINGS: Dict[str, Dict[str, Tuple[type, ...]]] = {
    "GRPOTrainer": {**_COMMON, "loss_type": (str,), "entropy_coef": _NUMBER, "use_adaptive_entropy": (bool,),
                    "top_entropy_quantile": _NUMBER, "importance_sampling_level": (str,),
                    "vllm_importance_sampling_correction": (bool,), "vllm_importance_sampling_mode": (str,),
                    "vllm_importance_sampling_clip_min": _MAYBE_NUMBER,
                    "vllm_importance_sampling_clip_max": _MAYBE_NUMBER},
    "RLOOTrainer": dict(_COMMON),
}


class FrameworkDrift(RuntimeError):
    """A name odb relies on is missing or changed in the installed transformers or TRL."""


def version_of(framework: str) -> str:
    """The installed version of ``framework`` (``"transformers"`` or ``"trl"``), or ``"not imported"``.

    Example:
        >>> version_of("transformers") != ""
        True
    """
    module = sys.modules.get(framework)
    return str(getattr(module, "__version__", "not imported")) if module is not None else "not imported"


def drift(framework: str, what: str, found: str) -> FrameworkDrift:
    """The error for a changed name: the installed version, the piece, what was found, the fix."""
    return FrameworkDrift(f"odb relies on {framework}'s {what}, tested with {TESTED[framework]}; the installed "
                          f"{framework} {version_of(framework)} {found}. odb would train wrong or fail later without "
                          f"it. Fix: pin the tested range (pip install '{TESTED[framework]}'), or train without odb.")


def names_of(owner: str) -> Tuple[FrameworkName, ...]:
    """The registered names of class ``owner`` (``"Trainer"``, ``"GRPOTrainer"``, ``"RLOOTrainer"``).

    Example:
        >>> [n.name for n in names_of("RLOOTrainer")][:2]
        ['_compute_loss', '_get_per_token_logps_and_entropies']
    """
    return tuple(n for n in NAMES if n.owner == owner)


def _describe(entry: FrameworkName) -> str:
    params = f"({', '.join(entry.params)})" if entry.kind == "method" else ""
    return f"{entry.owner}.{entry.name}{params}, which odb {_ROLES[entry.role]} ({entry.why})"


_ROLES = {"override": "overrides", "call": "calls", "stand-in": "stands in for", "read": "reads",
          "rewrite": "reads and rewrites", "wrap": "wraps"}


def check_classes(owner: str, cls: Any = None) -> None:
    """Raise ``FrameworkDrift`` unless every method of ``owner`` in ``NAMES`` exists on ``cls`` (default: the
    framework's own class, imported where odb expects it) and takes the parameters odb relies on."""
    if cls is None:
        try:
            cls = getattr(importlib.import_module(_MODULES[owner]), owner, None)
        except ImportError:
            cls = None
        if cls is None:
            raise drift("trl" if owner != "Trainer" else "transformers", f"{owner} in {_MODULES[owner]}",
                        "has no such class there")
    for entry in names_of(owner):
        if entry.kind != "method":
            continue
        method = getattr(cls, entry.name, None)
        if not callable(method):
            raise drift(entry.framework, _describe(entry), f"has no {owner}.{entry.name}")
        try:
            params = set(inspect.signature(method).parameters)
        except (TypeError, ValueError):
            params = set()
        missing = [p for p in entry.params if p not in params]
        if missing:
            raise drift(entry.framework, _describe(entry), f"has {owner}.{entry.name}({', '.join(sorted(params))}), "
                                                           f"without {missing}")


def check_instance(trainer: Any, owner: str) -> None:
    """Raise ``FrameworkDrift`` unless the built ``trainer`` holds every attribute of ``owner`` in ``NAMES`` and
    ``TRL_SETTINGS``, each of its expected type."""
    entries = [e for e in names_of(owner) if e.kind == "attribute"]
    entries += [FrameworkName(owner, name, "attribute", "read", "a setting odb decides by", types=types)
                for name, types in TRL_SETTINGS.get(owner, {}).items()]
    for entry in entries:
        if entry.name not in vars(trainer) and not hasattr(type(trainer), entry.name):
            raise drift(entry.framework, _describe(entry), f"sets no {owner}.{entry.name} on the trainer")
        value = getattr(trainer, entry.name)
        if entry.types and not isinstance(value, entry.types):
            raise drift(entry.framework, _describe(entry), f"sets {owner}.{entry.name} to a {type(value).__name__} "
                                                           f"({value!r:.60}), not a "
                                                           f"{' or '.join(t.__name__ for t in entry.types)}")


class StandIn:
    """Counts the calls of a method odb stands in for; ``expect_called(before, what)`` raises ``FrameworkDrift``
    unless the framework's code called it exactly once since ``before``: never (e.g. TRL renamed the call, and its
    own code ran instead), or more than once (odb prepares each call of its stand-in for one use).

    Example:
        >>> s = StandIn("GRPOTrainer", "_get_per_token_logps_and_entropies")
        >>> before = s.calls; s.calls += 1; s.expect_called(before, "a loss call")
    """

    def __init__(self, owner: str, name: str) -> None:
        self.entry = next(e for e in names_of(owner) if e.name == name)
        self.calls = 0

    def expect_called(self, before: int, what: str) -> None:
        calls, name = self.calls - before, f"{self.entry.owner}.{self.entry.name}"
        if calls == 0:
            raise drift(self.entry.framework, _describe(self.entry), f"never called {name} during {what}: odb's "
                        f"stand-in went unused and the framework's own code ran instead")
        if calls != 1:
            raise drift(self.entry.framework, _describe(self.entry), f"called {name} {calls} times during {what}, "
                        f"where odb's stand-in expects one call")


def owners_in(cls: type, owners: Iterable[str]) -> Tuple[str, ...]:
    """Which of ``owners`` (registered class names) are in ``cls``'s hierarchy, defined where odb expects them.

    Example:
        >>> owners_in(object, ("GRPOTrainer",))
        ()
    """
    return tuple(c.__name__ for c in cls.__mro__ if c.__name__ in owners and _MODULES.get(c.__name__) == c.__module__)
