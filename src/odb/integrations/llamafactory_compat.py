"""LLaMA-Factory 0.9.5 next to transformers 5: what its SFT workflow needs to import and run there.

``import_llamafactory`` imports the workflow (skipping LLaMA-Factory's own version check only where
it would refuse the installed transformers, with a warning); ``transformers5_args`` maps the options
transformers 5 renamed; ``swapped`` replaces a module attribute while a block runs (``run_exp`` swaps
in the trainer class that enables odb). odb.integrations.llamafactory is the integration itself.

Example:
    >>> transformers5_args({"stage": "sft", "warmup_steps": 10})
    {'stage': 'sft', 'warmup_steps': 10}
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.machinery
import importlib.util
import os
import sys
import types
import warnings
import weakref
from typing import Any, Iterator

# ---- LLaMA-Factory 0.9.5 on transformers 5 ------------------------------------------------------
_skipped_version_check = False  # whether import_llamafactory skipped LLaMA-Factory's version check in this process
_BOUND: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the factories _bound_layer_calls made (installed at most once)


def import_llamafactory() -> bool:
    """Import LLaMA-Factory's SFT workflow, with what it needs next to a newer transformers.

    ``run_exp`` calls it; call it yourself before ``load_model`` when you build the trainer
    or the loop yourself. Each step does nothing where it is not needed (an environment
    that ``pip install llamafactory`` resolved):

    - LLaMA-Factory 0.9.5 checks at import that transformers is <= 5.6 (and datasets <= 4.0).
      Where that check fails, odb warns once and imports it with its documented switch
      ``DISABLE_VERSION_CHECK=1`` set for the import only (``run_exp`` keeps it set while it
      runs, as LLaMA-Factory checks again). Returns whether it did, in this process.
    - ``llamafactory.data.mm_plugin`` imports ``torchaudio`` at module level. Where none is
      installed (no build matches a CPU-only torch 2.13), a stand-in module that fails on use
      is registered during the import and removed afterwards: text SFT never calls it.
    - LLaMA-Factory's gradient-checkpointing wrapper reads the layer as ``func.__self__``;
      transformers 5.23 passes ``partial(forward, layer, ...)``, which fails with
      ``'function' object has no attribute '__self__'``. The wrapper is given the layer as a
      bound method instead (same call, same arguments).

    Example::

        from odb.integrations.llamafactory import import_llamafactory
        import_llamafactory()
        from llamafactory.model import load_model   # gradient checkpointing works on transformers 5.23
    """
    global _skipped_version_check
    if "llamafactory.train.sft.workflow" not in sys.modules:
        with _torchaudio_stand_in():
            try:
                import llamafactory.train.sft.workflow  # noqa: F401
            except ImportError as err:
                if "DISABLE_VERSION_CHECK" not in str(err) or os.environ.get("DISABLE_VERSION_CHECK"):
                    raise
                warnings.warn(f"odb: LLaMA-Factory refused this environment at import ({str(err).splitlines()[0]}); "
                              f"odb imports it with DISABLE_VERSION_CHECK=1 (LLaMA-Factory's documented switch; "
                              f"odb's tests run its SFT path on the transformers docs/versions.md names). Fix, to "
                              f"silence this: install the versions LLaMA-Factory declares, or set "
                              f"DISABLE_VERSION_CHECK=1 yourself.",
                              stacklevel=2)
                _skipped_version_check = True
                with version_check_skipped(True):
                    import llamafactory.train.sft.workflow  # noqa: F401,F811
    from llamafactory.model.model_utils import checkpointing

    factory = checkpointing.get_custom_gradient_checkpointing_func
    if factory not in _BOUND:
        checkpointing.get_custom_gradient_checkpointing_func = _bound_layer_calls(factory)
    return _skipped_version_check


@contextlib.contextmanager
def version_check_skipped(skip: bool) -> Iterator[None]:
    if not skip or os.environ.get("DISABLE_VERSION_CHECK"):
        yield
        return
    os.environ["DISABLE_VERSION_CHECK"] = "1"
    try:
        yield
    finally:
        os.environ.pop("DISABLE_VERSION_CHECK", None)


@contextlib.contextmanager
def _torchaudio_stand_in() -> Iterator[None]:
    if "torchaudio" in sys.modules or importlib.util.find_spec("torchaudio") is not None:
        yield
        return
    import transformers.processing_utils  # noqa: F401  (reads whether torchaudio exists before a stand-in does)

    stand_in = types.ModuleType("torchaudio")
    stand_in.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)

    def missing(name: str) -> Any:
        raise ImportError(f"torchaudio.{name}: torchaudio is not installed (LLaMA-Factory's audio inputs need it). "
                          f"Fix: pip install torchaudio (a build matching your torch).")

    stand_in.__getattr__ = missing  # type: ignore[attr-defined]
    sys.modules["torchaudio"] = stand_in
    try:
        yield
    finally:
        if sys.modules.get("torchaudio") is stand_in:
            del sys.modules["torchaudio"]


def _bound_layer_calls(factory: Any) -> Any:
    """LLaMA-Factory's ``get_custom_gradient_checkpointing_func``, handed each layer call as a bound method."""
    import torch

    def make(gradient_checkpointing_func: Any) -> Any:
        custom = factory(gradient_checkpointing_func)

        @functools.wraps(custom)
        def call(func: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(func, functools.partial) and not hasattr(func.func, "__self__") and func.args \
                    and isinstance(func.args[0], torch.nn.Module):  # transformers 5.23: partial(forward, layer)
                func = functools.partial(types.MethodType(func.func, func.args[0]), *func.args[1:], **func.keywords)
            return custom(func, *args, **kwargs)

        return call

    _BOUND.add(make)
    return make


def transformers5_args(parsed: Any) -> Any:
    """``warmup_ratio`` (gone in transformers 5, whose ``warmup_steps`` below 1 is a ratio) as ``warmup_steps``."""
    from transformers import TrainingArguments

    if "warmup_ratio" in {f.name for f in dataclasses.fields(TrainingArguments)}:
        return parsed
    if isinstance(parsed, dict):
        if "warmup_ratio" not in parsed:
            return parsed
        out = dict(parsed)
        ratio = out.pop("warmup_ratio")
    else:
        argv, out, ratio = [str(a) for a in parsed], [], None
        i = 0
        while i < len(argv):
            if argv[i] == "--warmup_ratio" and i + 1 < len(argv):
                ratio, i = argv[i + 1], i + 2
                continue
            if argv[i].startswith("--warmup_ratio="):
                ratio = argv[i].split("=", 1)[1]
            else:
                out.append(argv[i])
            i += 1
        if ratio is None:
            return parsed
    given = out.get("warmup_steps") if isinstance(out, dict) else next(
        (a for a in out if a == "--warmup_steps" or a.startswith("--warmup_steps=")), None)
    if given is not None:
        raise ValueError(f"the config sets both warmup_ratio={ratio} and warmup_steps. Rule: transformers 5 has no "
                         f"warmup_ratio; its warmup_steps takes a ratio when below 1. Fix: keep one of them.")
    value = float(ratio)
    if not 0 <= value < 1:
        raise ValueError(f"the config sets warmup_ratio={ratio}. Rule: a ratio of the training steps, in [0, 1). "
                         f"Fix: pass e.g. warmup_ratio: 0.1.")
    warnings.warn(f"odb: transformers 5 has no warmup_ratio (LLaMA-Factory's examples set it); odb passes "
                  f"warmup_ratio={value} as warmup_steps={value}, which transformers 5 reads as the same ratio of the "
                  f"training steps. Fix, to silence this: write warmup_steps: {value}.", stacklevel=3)
    if isinstance(out, dict):
        out["warmup_steps"] = value
    else:
        out += ["--warmup_steps", str(value)]
    return out


# ---- the trainer ------------------------------------------------------------------------


@contextlib.contextmanager
def swapped(module: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)
