"""``token_budget="auto"`` in the integrations: the memory meter a trainer integration defaults to.

Without CUDA, ``ODBConfig`` refuses ``token_budget="auto"`` unless ``memory_meter`` is given
(there is no allocator peak to read). An integration that holds the model before it builds
the config (the HF Trainer's and TRL's ``enable_odb``) passes ``auto_meter_options`` its
options: when the budget is ``"auto"``, no meter was passed and the model does not train on
a CUDA device, the options gain ``memory_meter=odb.train.memory.ActivationMeter(model)`` (the
activation memory of the model's forward). On CUDA nothing changes: the loader's default
``CudaPeakMeter`` measures the whole step. ``memory_cap_bytes`` is never defaulted (without a
device there is no total memory to take a fraction of): the config still refuses, naming it.

Example:
    >>> import torch
    >>> from odb.integrations.memory import auto_meter_options
    >>> model = torch.nn.Linear(2, 2)
    >>> auto_meter_options("auto", None, {}, model, torch.device("cpu"))
    {'memory_meter': ActivationMeter(Linear, open)}
    >>> auto_meter_options(4096, None, {}, model)   # an int budget: unchanged
    {}
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from odb.config import AUTO, ODBConfig
from odb.train.memory import ActivationMeter

__all__ = ["auto_meter_options", "measure_auto_explicitly", "needs_activation_meter"]


def needs_activation_meter(device: Any = None) -> bool:
    """Whether a model on ``device`` (None: wherever torch would put it) has no CUDA allocator peak to read."""
    if not torch.cuda.is_available():
        return True
    return device is not None and torch.device(device).type != "cuda"


def auto_meter_options(token_budget: Any, config: Optional[ODBConfig], options: Dict[str, Any], model: Any,
                       device: Any = None) -> Dict[str, Any]:
    """``options`` with ``memory_meter=ActivationMeter(model)`` added when the budget (``token_budget``, else
    ``options``' or ``config``'s) is ``"auto"``, neither ``options`` nor ``config`` holds a meter, ``model`` is a
    ``torch.nn.Module`` and it trains on ``device`` without CUDA (``needs_activation_meter``); else ``options``
    unchanged. Call it before the ODBConfig is built (its validation refuses "auto" without a meter on CPU)."""
    budget = token_budget if token_budget is not None else \
        options.get("token_budget", config.token_budget if config is not None else None)
    if not (isinstance(budget, str) and budget == AUTO):
        return options
    if options.get("memory_meter") is not None or (config is not None and config.memory_meter is not None):
        return options
    if not isinstance(model, torch.nn.Module) or not needs_activation_meter(device):
        return options
    return dict(options, memory_meter=ActivationMeter(model))


def measure_auto_explicitly(loader: Any, lookahead: int) -> Any:
    """For a framework that fetches batches before it trains them (the HF Trainer pulls a whole optimizer
    step's micro-batches first; Lightning fetches one ahead), the loader's next() does not mark the end of a
    batch's step: the integration then calls ``begin(step, ghost)``/``end()`` of the returned
    ``odb.epoch.auto.AutoControl`` around each micro-batch it trains, and each window's plan waits only for
    the steps up to ``lookahead`` (the most batches the framework holds fetched and not yet trained) before
    its freeze point. None when the loader's budget is not "auto".

    Example:
        >>> print(measure_auto_explicitly(object(), 4))
        None
    """
    auto = getattr(getattr(loader, "odb_core", None), "auto", None)
    if auto is not None:
        auto.measure_explicitly(lookahead)
    return auto
