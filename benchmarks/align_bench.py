"""Time odb's pure rank alignment for one window at many simulated ranks.

Per window, every rank runs decide_steps on the gathered header, step_imbalance on the
gathered (world, S, 3) step summaries, and global_steps (with the shared step order)
to build its own step plans. This times that work on one rank; the collectives are
not included. The same figure is part of `python -m odb.bench` (section "Ranks").

    python benchmarks/align_bench.py [--world 1024] [--steps 30] [--windows 200]
"""

from __future__ import annotations

import argparse

from odb.bench.ranks_bench import time_alignment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30, help="about this many steps per window")
    parser.add_argument("--windows", type=int, default=200)
    args = parser.parse_args()
    ms = time_alignment(args.world, args.steps, args.windows)
    print(f"align: world={args.world}, about {args.steps} steps per window: median {ms:.3f} ms per window "
          f"({args.windows} windows)")


if __name__ == "__main__":
    main()
