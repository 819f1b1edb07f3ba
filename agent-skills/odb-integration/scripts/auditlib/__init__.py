"""The static audit behind audit_integration.py (standard library only; code is read with ``ast``)."""

from __future__ import annotations

from typing import Callable, List

from detect_framework import ScriptIndex

from .loader_checks import (check_distributed, check_eval_loaders, check_loader_args, check_odb_missing,
                            check_token_budget)
from .loaders import loader_sites
from .loop_checks import check_integration_missing, check_loops
from .rules import RULES, Context, Finding, integration_uses
from .trainer_checks import check_hf, check_integration_order, check_lightning, check_llamafactory, check_mixin_order

__all__ = ["RULES", "Finding", "audit_index"]

CHECKS: List[Callable[[Context], List[Finding]]] = [
    check_odb_missing, check_integration_missing, check_token_budget, check_loader_args, check_eval_loaders,
    check_distributed, check_loops, check_integration_order, check_mixin_order, check_hf,
    check_lightning, check_llamafactory,
]


def audit_index(index: ScriptIndex, framework: str, distributed: bool) -> List[Finding]:
    """Every finding of every check on a parsed script audited as ``framework``."""
    ctx = Context(index, framework, distributed, loader_sites(index), integration_uses(index))
    findings: List[Finding] = []
    for check in CHECKS:
        findings += check(ctx)
    return findings
