"""The cost of a batch, and how many samples fit under the budget (pure numpy).

A batch of B samples whose longest padded sample has length L costs B x L per length
dimension. With one budget the dimensions are summed; with one budget per dimension
each dimension is bounded on its own. ``quadratic_length`` q makes each padded token
cost ``1 + L / q`` (attention is quadratic in L). An optional cap bounds the sum of
image patches in a batch.

In the packed layout (``layout="packed"``) a batch is one row of its samples end to
end: it costs the sum of its samples' weights (``L`` each, ``L + L^2 / q`` with
``quadratic_length``), so a row of a few long samples and one of many short ones cost
alike; nothing is padded.

``sample_cost`` adds a fixed cost per sample, in tokens-equivalent (default 0): a padded
batch then costs B x (weights of its longest sample + sample_cost), a packed row the sum of
(weight + sample_cost) over its samples. It maps a memory model with a per-sample term
(``odb.plan.auto.auto_budget``) exactly onto the planner; with one budget per dimension each
dimension's cost carries it.

Per-sample side costs, in tokens-equivalent, added to a batch as a *sum over its samples* (never
padded to the longest): ``image_patch_cost`` per image patch (a vision tower runs on every image's
patches concatenated, whatever the text's padding) and ``loss_token_cost`` per supervised token
(labels != ignore_index: a chunked or fused loss materializes logits for those tokens only). A
padded batch then costs ``B x (weight of its longest sample + sample_cost) + sum of its samples'
side costs``; a packed row adds each sample's side cost to its weight. Both are 0 by default: the
planner then needs no side counts. The planner receives them as a *side* array per sample:
``(n,)`` image patches, or ``(n, 2)`` image patches and supervised tokens (``split_side``). With one
budget per length dimension the side costs count toward the first dimension's budget.

With ``shape_buckets`` a padded length is further rounded up to the smallest of a few
bucket lengths (``odb.plan.costs.buckets``); a sample longer than the largest bucket fits no batch
(oversize).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Tuple

import numpy as np

from odb.plan.costs.buckets import bucket_lengths
from odb.plan.costs.plan_costs import PlanCosts

if TYPE_CHECKING:  # plan/ is pure numpy: the config is only read, never imported at run time
    from odb.config import ODBConfig


# Quadratic weights are floats: a batch whose exact cost equals the budget may compute
# a hair above it. Integer-length costs (no quadratic term) are exact and unaffected.
_ULP = 1.0 + 1e-12


def split_side(side: Any) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """(image patches, supervised tokens) of a side array: None, (n,) patches, or (n, 2) both.

    Example:
        >>> [None if v is None else v.tolist() for v in split_side(np.array([[4, 7], [0, 3]]))]
        [[4, 0], [7, 3]]
        >>> split_side(np.array([4, 0]))[1] is None
        True
    """
    if side is None:
        return None, None
    arr = np.asarray(side)
    if arr.ndim == 2:
        return arr[:, 0], arr[:, 1]
    return arr, None


class CostModel:
    """Batch cost and feasibility under one ODBConfig.

    The one place a group's cost is defined (callers elsewhere ask it, they do not recompute):
    ``batch_cost`` (of padded lengths) is what the budget bounds; ``group_tokens`` the tokens a
    batch holds (its padded tokens; packed: its real ones); ``group_cost`` what ranks compare to
    pair groups of similar cost in one step.

    Example:
        >>> import numpy as np
        >>> from odb.config import ODBConfig
        >>> cm = CostModel.from_config(ODBConfig(token_budget=100, pad_to_multiple_of=8))
        >>> cm.batch_cost(cm.pad(np.array([[10], [3]])))
        32.0
        >>> CostModel((100,), layout="packed").batch_cost(np.array([[10], [3]]))
        13.0
        >>> CostModel((100,), length_buckets=(16, 32)).pad(np.array([[10], [17]])).ravel().tolist()
        [16, 32]
    """

    def __init__(
        self,
        budgets: Tuple[int, ...],
        pad_to_multiple_of: int = 1,
        quadratic_length: Optional[int] = None,
        max_batch_size: Optional[int] = None,
        batch_size_multiple: int = 1,
        max_patches: Optional[int] = None,
        layout: str = "padded",
        length_buckets: Optional[Tuple[int, ...]] = None,
        sample_cost: float = 0.0,
        image_patch_cost: float = 0.0,
        loss_token_cost: float = 0.0,
    ) -> None:
        self.budgets = np.asarray(budgets, dtype=np.float64)
        self.pad_to = pad_to_multiple_of
        self.q = quadratic_length
        self.max_batch = max_batch_size if max_batch_size is not None else np.iinfo(np.int64).max
        self.multiple = batch_size_multiple
        self.max_patches = max_patches
        self.packed = layout == "packed"
        self.buckets = None if length_buckets is None else tuple(int(v) for v in length_buckets)
        self.sample_cost = float(sample_cost)
        self.image_patch_cost = float(image_patch_cost)
        self.loss_token_cost = float(loss_token_cost)
        for name, value in (("sample_cost", sample_cost), ("image_patch_cost", image_patch_cost),
                            ("loss_token_cost", loss_token_cost)):
            if not np.isfinite(float(value)) or float(value) < 0:
                raise ValueError(
                    f"{name}={value!r}: the cost a sample adds to a batch must be a finite number >= 0 "
                    f"(tokens-equivalent). Fix: pass {name}=0.0 (none) or a positive float.")

    @classmethod
    def from_config(cls, cfg: ODBConfig, costs: Optional[PlanCosts] = None) -> "CostModel":
        """The model of ``cfg``'s options, priced by ``costs`` (default: the ones ``cfg`` sets). Lengths are
        padded to ``cfg.length_multiple`` (``pad_to_multiple_of``, and what context parallelism needs), in
        packed rows sample by sample."""
        costs = costs if costs is not None else PlanCosts.of(cfg)
        return cls(costs.token_budgets, cfg.length_multiple, costs.quadratic_length, cfg.max_batch_size,
                   cfg.batch_size_multiple, cfg.max_image_patches, cfg.layout, cfg.shape_buckets,
                   costs.sample_cost, costs.image_patch_cost, costs.loss_token_cost)

    @property
    def side_costs(self) -> bool:
        """Whether samples' image patches or supervised tokens cost (the planner then needs side counts)."""
        return self.image_patch_cost > 0 or self.loss_token_cost > 0

    def side_cost(self, side: Any) -> Optional[np.ndarray]:
        """(n,) tokens-equivalent each sample adds to a batch beyond its length: ``image_patch_cost`` x its
        patches + ``loss_token_cost`` x its supervised tokens; None when nothing is added.

        Example:
            >>> CostModel((100,), image_patch_cost=0.5, loss_token_cost=2.0).side_cost(
            ...     np.array([[4, 1], [0, 3]])).tolist()
            [4.0, 6.0]
        """
        patches, supervised = split_side(side)
        out = None
        if patches is not None and self.image_patch_cost:
            out = self.image_patch_cost * patches.astype(np.float64)
        if supervised is not None and self.loss_token_cost:
            more = self.loss_token_cost * supervised.astype(np.float64)
            out = more if out is None else out + more
        return out

    def scaled(self, factor: float) -> "CostModel":
        """The same model with every token budget multiplied by ``factor``."""
        out = CostModel.__new__(CostModel)
        out.__dict__.update(self.__dict__)
        out.budgets = self.budgets * factor
        return out

    @property
    def total_budget(self) -> float:
        return float(self.budgets.sum())

    @property
    def row_capacity(self) -> float:
        """The most one packed row may cost: the budget (with room for the float error of quadratic weights)."""
        return self.total_budget * _ULP

    def check_dims(self, n_dims: int) -> None:
        """Raise if the budget does not fit the number of length dimensions."""
        if len(self.budgets) not in (1, n_dims):
            raise ValueError(
                f"token_budget has {len(self.budgets)} entries but samples have {n_dims} length dimensions: "
                f"the budget must be one int (summed over dimensions) or one per dimension. "
                f"Fix: pass token_budget=<int> or a tuple of {n_dims} ints.")

    @property
    def bucketed(self) -> bool:
        """Padded lengths are rounded to ``shape_buckets``."""
        return self.buckets is not None

    def pad(self, lengths: np.ndarray) -> np.ndarray:
        """Lengths (n, D) rounded up to pad_to_multiple_of, then to the smallest bucket that holds them. An
        empty sample (0 tokens) is priced as one token: it takes a place in its batch like any sample, and no
        batch's length, no count of samples that fit, is zero.

        Example:
            >>> CostModel((100,), pad_to_multiple_of=8).pad(np.array([[0], [1], [9]])).ravel().tolist()
            [8, 8, 16]
        """
        lengths = np.maximum(np.asarray(lengths, dtype=np.int64), 1)
        if self.pad_to != 1:
            lengths = -(-lengths // self.pad_to) * self.pad_to
        if self.buckets is not None:
            lengths = bucket_lengths(lengths, self.buckets)
        return lengths

    def plan_tokens(self, lengths: np.ndarray, padded: np.ndarray) -> np.ndarray:
        """(n,) what each sample counts toward a batch's packing efficiency: its real tokens, or with
        ``shape_buckets`` its bucket's length (a batch of one bucket pads to it whatever its neighbours,
        so only a full batch of one bucket is fully packed).

        Example:
            >>> CostModel((64,), length_buckets=(8, 16)).plan_tokens(np.array([[5]]), np.array([[8]])).tolist()
            [8.0]
        """
        chosen = padded if self.buckets is not None else lengths
        return np.asarray(chosen).sum(axis=1).astype(np.float64)

    def token_weight(self, padded: np.ndarray) -> np.ndarray:
        """Cost of one sample padded to these lengths, per dimension (float)."""
        w = padded.astype(np.float64)
        return w if self.q is None else w * (self.q + w) / self.q

    def _with_sample_cost(self, w: np.ndarray) -> np.ndarray:
        """A per-sample cost (summed weights, or one per dimension) plus ``sample_cost`` (unchanged at 0)."""
        return w + self.sample_cost if self.sample_cost else w

    def per_sample_cost_ok(self, w_max: np.ndarray, counts: np.ndarray,
                           side_sum: Optional[np.ndarray] = None) -> np.ndarray:
        """Whether each of K padded batches fits the budget: ``counts[k]`` samples padded to the weights
        ``w_max[k]`` (one per length dimension) of its longest ones, plus ``sample_cost`` each, plus
        ``side_sum[k]`` (its samples' side costs, toward the first dimension), every dimension within
        its budget."""
        extra = 0.0 if side_sum is None else side_sum
        if len(self.budgets) == 1:
            return counts * self._with_sample_cost(w_max.sum(axis=1)) + extra <= self.budgets[0] * _ULP
        per_dim = counts[:, None] * self._with_sample_cost(w_max)
        per_dim[:, 0] += extra
        return (per_dim <= self.budgets[None, :] * _ULP).all(axis=1)

    def batch_cost(self, padded_group: np.ndarray, side: Any = None) -> float:
        """Cost of one batch: B x (sum over dimensions of the weight of the max length + sample_cost),
        plus its samples' side costs (``side``: their side counts, see ``split_side``); packed: the sum
        of its samples' weights (each with its sample_cost and side cost).

        Example:
            >>> CostModel((100,), sample_cost=2.0).batch_cost(np.array([[10], [3]]))
            24.0
            >>> CostModel((100,), image_patch_cost=0.5).batch_cost(np.array([[10], [3]]), np.array([8, 0]))
            24.0
        """
        padded_group = np.asarray(padded_group)
        if self.packed:
            return float(self.sample_weights(padded_group, side).sum())
        w = self.token_weight(padded_group.max(axis=0))
        extra = self.side_cost(side)
        return float(len(padded_group) * self._with_sample_cost(w.sum()) + (0.0 if extra is None else extra.sum()))

    def sample_weights(self, padded: np.ndarray, side: Any = None) -> np.ndarray:
        """(n,) what each sample adds to a packed row: its weights summed over length dimensions, plus
        ``sample_cost``, plus its side cost."""
        w = self._with_sample_cost(self.token_weight(np.asarray(padded).reshape(len(padded), -1)).sum(axis=1))
        extra = self.side_cost(side)
        return w if extra is None else w + extra

    @property
    def integer_weights(self) -> bool:
        """Every sample weight is an integer (no quadratic term, integer sample and side costs): packing may
        use ints."""
        return self.q is None and all(float(v).is_integer() for v in (self.sample_cost, self.image_patch_cost,
                                                                      self.loss_token_cost))

    def group_tokens(self, lengths: np.ndarray) -> int:
        """Tokens a batch of these (n, D) lengths holds: B x padded max per dimension; packed: the real ones.

        Example:
            >>> lengths = np.array([[10], [3]])
            >>> CostModel((100,)).group_tokens(lengths), CostModel((100,), layout="packed").group_tokens(lengths)
            (20, 13)
        """
        lengths = np.asarray(lengths)
        if self.packed:
            return int(lengths.sum())
        return int(len(lengths) * self.pad(lengths).max(axis=0).sum())

    def group_cost(self, lengths: np.ndarray, side: Any = None) -> int:
        """What ranks compare to pair groups of similar cost in one step: B x L (padded), the row's
        cost rounded (packed, with its attention term when ``quadratic_length`` is set), plus the
        samples' side costs (vision patches, supervised tokens) when they cost.

        Example:
            >>> CostModel((100,), image_patch_cost=0.5).group_cost(np.array([[10], [3]]), np.array([8, 0]))
            24
        """
        if self.packed:
            return int(round(self.batch_cost(lengths, side)))
        extra = self.side_cost(side)
        return self.group_tokens(lengths) + (0 if extra is None else int(round(float(extra.sum()))))

    def copies_that_fit(self, padded: np.ndarray, side: Any) -> np.ndarray:
        """For each sample, how many copies of it fit in one batch (0: oversize); ``side``: the samples'
        side counts (``split_side``), or None."""
        patches, _ = split_side(side)
        fit = self.copies_that_fit_unrounded(padded, self.side_cost(side))
        if patches is not None and self.max_patches is not None:
            by_patch = np.where(patches > 0, self.max_patches // np.maximum(patches, 1), fit)
            fit = np.minimum(fit, by_patch)
        return self.round_to_multiple(fit)

    def round_to_multiple(self, counts: np.ndarray) -> np.ndarray:
        """Round counts down to batch_size_multiple where they reach it (budget wins below it)."""
        if self.multiple == 1:
            return counts
        return np.where(counts >= self.multiple, counts - counts % self.multiple, counts)

    def max_counts_sorted(self, padded: np.ndarray, side: Any) -> np.ndarray:
        """For samples sorted by decreasing size, the largest feasible batch starting at each i.

        The batch starting at i holds samples i .. i+b-1; the result is b before the
        batch_size_multiple rounding, never above the samples that remain. ``side``: the
        samples' side counts (``split_side``), or None.
        """
        n, dims = padded.shape
        patches, _ = split_side(side)
        extra = self.side_cost(side)
        remaining = np.arange(n, 0, -1, dtype=np.int64)
        if dims == 1 and extra is None:
            # Sorted by decreasing length, the first sample of a batch is its longest.
            counts = np.minimum(self.copies_that_fit_unrounded(padded), remaining)
        else:
            w = self.token_weight(padded)
            # A batch holding sample i costs at least B x its weight, so it holds at most
            # the copies of i's weight that fit: the scan from i stops there. Side costs sum over the run.
            caps = self.copies_that_fit_unrounded(padded)
            counts = np.empty(n, dtype=np.int64)
            for i in range(n):
                k = int(min(n - i, caps[i]))
                run = np.maximum.accumulate(w[i:i + k], axis=0)
                ok = self.per_sample_cost_ok(run, np.arange(1, k + 1),
                                             None if extra is None else np.cumsum(extra[i:i + k]))
                counts[i] = k if ok.all() else int(np.argmin(ok))
        if patches is not None and self.max_patches is not None:
            cum = np.concatenate(([0], np.cumsum(patches)))
            by_patch = np.searchsorted(cum, cum[:-1] + self.max_patches, side="right") - 1 - np.arange(n)
            counts = np.minimum(counts, by_patch)
        return counts

    def copies_that_fit_unrounded(self, padded: np.ndarray, side_cost: Optional[np.ndarray] = None) -> np.ndarray:
        """Copies of each sample that fit the token budget and max_batch_size (``side_cost``: each sample's
        side cost, ``side_cost(side)``, added to its per-sample cost)."""
        w = self.token_weight(padded)
        if len(self.budgets) == 1:
            per = self._with_sample_cost(w.sum(axis=1))
            if side_cost is not None:
                per = per + side_cost
            fit = np.floor(self.budgets[0] * _ULP / np.maximum(per, 1e-9))
        else:
            per = self._with_sample_cost(w)
            if side_cost is not None:
                per = per.copy()
                per[:, 0] += side_cost
            fit = np.floor(self.budgets[None, :] * _ULP / np.maximum(per, 1e-9)).min(axis=1)
        if self.buckets is not None:  # longer than the largest bucket: no batch shape holds it
            fit = np.where((np.asarray(padded) > self.buckets[-1]).any(axis=1), 0, fit)
        return np.minimum(fit, self.max_batch).astype(np.int64)
