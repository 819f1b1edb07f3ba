"""Torch data plumbing: samplers, sample lengths, and how samples travel from the workers.

``sampling`` (``ShardSampler``, the chunk sampler of the inner DataLoader), ``lengths`` (what a
sample costs: its token counts), ``source`` (chunks of sample records from the workers, the
read-ahead buffer of one window), ``stream_state`` (an IterableDataset with its own state),
``collate_check`` and ``bucket_collate`` (collate wrappers).
"""
