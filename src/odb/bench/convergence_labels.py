"""The convergence section's arms in words, shared by what runs them (``odb.bench.convergence``) and what reports
them (``odb.bench.report``, which imports no torch).

Example:
    >>> LABELS["odb_gbl_padded"]
    "odb padded on group_by_length's steps"
"""

from __future__ import annotations

from typing import Dict

__all__ = ["LABELS"]

LABELS: Dict[str, str] = {
    "fixed": "fixed", "group_by_length": "group_by_length", "batch_rebalance": "BatchRebalance",
    "trl_packing": "TRL packing", "odb_padded": "odb padded", "odb_packed": "odb packed",
    "odb_budget_filled": "odb budget-filled", "odb_padded_rank": "odb padded, per-rank plan",
    "odb_gbl_padded": "odb padded on group_by_length's steps",
    "odb_gbl_packed": "odb packed on group_by_length's steps",
    "odb_length_grouped": "odb length_grouped", "odb_length_grouped_packed": "odb length_grouped packed"}
