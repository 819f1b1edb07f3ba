"""What ``drop_last`` drops of a rank's last, partial optimizer step (with ``global_batch_size``).

A plain loop over ``DataLoader(batch_size=B, drop_last=True)`` drops only each rank's last partial
batch of B and steps on the whole batches before it (the Trainer, Accelerate and Lightning step on a
last, short accumulation). odb does the same when it knows B (``ODBDataLoader(batch_size=B)``,
``odb.apply`` on a ``DataLoader(batch_size=B)``, the HF Trainer's ``per_device_train_batch_size``); with
``global_batch_size`` alone there is no batch to keep whole, and the partial last step is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["DropLast"]


@dataclass(frozen=True)
class DropLast:
    """``enabled``: the loader's ``drop_last``; ``unit``: the samples of one of the user's batches on a rank
    (None: unknown, so a partial last step is dropped whole).

    Example:
        >>> DropLast(True, unit=4).kept(10, step_samples=12)   # two whole batches of 4, the last 2 dropped
        8
        >>> DropLast(True).kept(10, step_samples=12), DropLast(False, unit=4).kept(10, step_samples=12)
        (0, 10)
        >>> DropLast(True, unit=4).kept(12, step_samples=12)   # a full step keeps everything
        12
    """

    enabled: bool
    unit: Optional[int] = None

    def kept(self, n: int, step_samples: int) -> int:
        """How many of a rank's ``n`` last samples (its data has ended) its last step keeps."""
        if not self.enabled or n >= step_samples:
            return n
        return 0 if self.unit is None else n - n % self.unit

    def steps(self, n: int, step_samples: int) -> int:
        """Optimizer steps of a rank holding ``n`` samples in an epoch.

        Example:
            >>> DropLast(True, unit=4).steps(30, 12), DropLast(True).steps(30, 12), DropLast(False).steps(30, 12)
            (3, 2, 3)
        """
        if not self.enabled:
            return -(-n // step_samples)
        whole, rest = divmod(n, step_samples)
        return whole + int(self.kept(rest, step_samples) > 0)
