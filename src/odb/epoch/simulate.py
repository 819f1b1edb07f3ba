"""Simulate N ranks in one process: the real engine per rank, a thread per rank.

The ranks exchange through the real protocol over threads (odb.comm.threads.ThreadRanks).

Used by tests and benchmarks to check the distributed protocol without processes;
also handy to preview how a length distribution will be batched across ranks.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Sequence

import numpy as np

from odb.comm.threads import ThreadRanks
from odb.config import ODBConfig
from odb.epoch.run import EpochRun
from odb.data.source import SampleMeter, SampleSource
from odb.step_info import ODBStepInfo, pop_step_info


def simulate_ranks(lengths_per_rank: Sequence[np.ndarray], cfg: ODBConfig, *, epoch: int = 0, seed: int = 0,
                   shuffle: bool = True, loss_tokens_per_rank: Sequence[np.ndarray] = ()
                   ) -> Dict[str, Any]:
    """Run one epoch of every rank's real EpochRun over lengths alone.

    Sample ids are ``rank * 10**9 + position``. Returns per-rank lists of ODBStepInfo
    and of epoch stats.

    Example:
        >>> out = simulate_ranks([np.array([5, 5, 9]), np.array([3])], ODBConfig(token_budget=10, buffer_size=4))
        >>> [len(s) for s in out["infos"]]
        [2, 2]
    """
    world = len(lengths_per_rank)
    ranks = ThreadRanks(world)
    infos: List[List[ODBStepInfo]] = [[] for _ in range(world)]
    stats: List[Dict[str, Any]] = [{} for _ in range(world)]
    errors: List[BaseException] = []
    sim_cfg = cfg.replace(length_fn=_sample_length, loss_tokens_fn=_sample_loss)

    def run(rank: int) -> None:
        er = None
        try:
            lengths = np.asarray(lengths_per_rank[rank])
            loss = loss_tokens_per_rank[rank] if loss_tokens_per_rank else (lengths[:, 0] if lengths.ndim > 1
                                                                            else lengths)
            meter = SampleMeter(sim_cfg)
            records = []
            for i in range(len(lengths)):
                sid, sample = rank * 10**9 + i, (lengths[i].tolist(), int(loss[i]))
                records.append((sid, sid, sample, meter(sid, sample)))  # (position, index, sample, meta)
            chunks = [records[i:i + 64] for i in range(0, len(records), 64)]
            source = SampleSource(chunks, cap_samples=sim_cfg.buffer_size, cap_tokens=sim_cfg.window_tokens,
                                  threaded=False)
            er = EpochRun(sim_cfg, source, _keep, epoch=epoch, seed=seed, shuffle=shuffle,
                          exchange=ranks.exchanges(rank)(ranks.timeout_s))
            for batch, _ in er:
                infos[rank].append(pop_step_info(batch))
            stats[rank] = er.stats.as_dict()
        except BaseException as err:  # surface the failure instead of leaving the others waiting
            errors.append(err)
            if er is not None:  # as a loader does: the other ranks' next exchange raises
                er.aligner.announce(err)
            ranks.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return {"infos": infos, "stats": stats}


def _sample_length(sample: Any) -> Any:
    return sample[0]


def _sample_loss(sample: Any) -> int:
    return sample[1]


def _keep(samples: List[Any]) -> Dict[str, Any]:
    return {"samples": samples}
