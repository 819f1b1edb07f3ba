"""An RL trainer's rollout rows cut into micro-steps: on their own rank (``per_rank``) or over all ranks, rows
moving (``across_ranks``)."""
