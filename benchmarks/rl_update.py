"""TRL's GRPO policy update with and without odb on the same rollouts, and an RL step's plans on 8 to 128
simulated ranks (TRL's slices, verl-style balancing, odb's rollout and global plans).

    .venv/bin/python benchmarks/rl_update.py [--quick] [--world 2] [--out out/rl_update]

The benchmark lives in ``odb.bench.rl_update`` (``make demo`` runs it as one of its sections; ``--skip-rl``
leaves it out); this script runs it alone and writes ``results.json`` and ``summary.md`` under ``--out``.
"""

from odb.bench.rl_update import main

if __name__ == "__main__":
    main()
