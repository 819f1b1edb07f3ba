"""The loader's budget, made once from the user's options (see odb.epoch.budget).

``make_budget`` gives a ``FixedBudget`` (an int or per-dimension ``token_budget``, with its
``budget_schedule``) or, for ``token_budget="auto"``, the ``AutoControl`` with its memory cap and
meter (CUDA's, unless the options name others).

Example:
    >>> from odb.config import ODBConfig
    >>> type(make_budget(ODBConfig(token_budget=64), None)).__name__
    'FixedBudget'
    >>> type(make_budget(ODBConfig(token_budget="auto", memory_cap_bytes=10**9, memory_meter=lambda: None),
    ...                  None)).__name__
    'AutoControl'
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from odb.config import ODBConfig
from odb.epoch.auto import AutoControl
from odb.epoch.budget import FixedBudget


def make_budget(cfg: ODBConfig, lengths: Optional[Sequence[Any]]) -> Any:
    """The budget of a loader with options ``cfg`` (``lengths``: the known lengths it was given, if any)."""
    return auto_control(cfg, lengths) if cfg.auto else FixedBudget(cfg)


def auto_control(cfg: ODBConfig, lengths: Optional[Sequence[Any]]) -> AutoControl:
    """The AutoControl of a loader with token_budget="auto": its cap (``memory_cap_bytes``, else
    ``memory_fraction`` of the CUDA device's memory) and meter (``memory_meter``, else CUDA's peak)."""
    if lengths is not None:
        raise ValueError("odb got lengths= with token_budget='auto': with known lengths the whole plan is made "
                         "before any step is measured. Rule: token_budget='auto' plans online. Fix: drop lengths=, "
                         "or pass an int token_budget.")
    cap = cfg.memory_cap_bytes
    if cap is None:  # ODBConfig refused "auto" without a cap where CUDA is not available
        device = torch.cuda.current_device()
        cap = int(cfg.memory_fraction * torch.cuda.get_device_properties(device).total_memory)
    meter = cfg.memory_meter
    if meter is None:
        from odb.train.memory import CudaPeakMeter

        meter = CudaPeakMeter()
    control = AutoControl(cap=float(cap), meter=meter, packed=cfg.layout == "packed", margin=cfg.auto_margin,
                          time_balance=cfg.balance == "time", options=cfg)
    control.wait_limit_s = float(cfg.exchange_timeout_s)
    return control
