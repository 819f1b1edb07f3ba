"""The epoch's producer: from sample records to batches with their step infos.

``run`` (``EpochRun``: windows, planner, rank alignment, step infos), ``windows`` (how its windows
are read and planned: one strategy per way), ``position`` (where it stands, resume bookkeeping),
``emission`` (the planned steps it hands out, their collate), ``ranks`` (the rank
aligner: exchanges and applies the fitting decisions), ``pool`` (the samples waiting in a
window), ``pipeline`` (the batch thread and its bounded queue), ``known`` (the epoch when
every length is known up front: planned in the inner loader's batch sampler), ``stats``
(its counters) and ``simulate`` (an epoch of several ranks in one process).
"""
