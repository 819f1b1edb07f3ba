"""The convergence section of ``python -m odb.bench``: its 2 DDP ranks launched, the goals and the plot.

Apart from ``odb.bench.convergence`` (what each rank runs), which the launched workers import:
the launcher imports it, never the other way round.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Sequence

from odb.bench.convergence import ARMS, BASE_LR, CAP, SIZES, breakdown, convergence_goals


def run_convergence_section(*, quick: bool = False, device: str = "cpu", out_dir: Optional[str] = None,
                            timeout_s: float = 1800.0, size: Optional[Dict[str, Any]] = None,
                            arms: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """The first section of ``python -m odb.bench``: 2 gloo ranks, every arm, A = 1 and 8; the goals; the plot.

    ``size`` replaces ``SIZES["full"]`` (or ``"quick"``) and ``arms`` the arms (``ARMS``, in its order): ``make
    demo``'s smaller run (``odb.bench.demo``)."""
    from odb.bench.training_ddp import launch

    size = dict(size) if size is not None else SIZES["quick" if quick else "full"]
    unknown = sorted(set(arms or ()) - set(ARMS))
    if unknown:
        raise ValueError(f"convergence arms {unknown} are not among {list(ARMS)}. Fix: name arms of ARMS.")
    chosen = [a for a in ARMS if arms is None or a in arms]
    params = {"device": device, "cap": CAP, "threads": 1,
              "convergence": {**size, "base_lr": BASE_LR, "arms": chosen}}
    res = launch(params, world=2, timeout_s=timeout_s)
    conv = res["convergence"]
    from odb.bench.training_run import MODELS

    conv["model"] = dict(MODELS["cuda" if str(device).startswith("cuda") else "cpu"])
    conv["goals"] = convergence_goals(conv) + convergence_goals(conv, "1", plans_only=True)
    conv["breakdown"] = breakdown(conv)
    conv["breakdowns"] = {acc: breakdown(conv, acc) for acc in conv["accumulations"]}
    if out_dir:
        from odb.bench.report import plot_convergence

        plot_convergence(conv, os.path.join(out_dir, "training_loss.png"))
    return conv
