"""``token_budget="auto"`` against the budgets a user could pick, every arm under one memory cap.

    .venv/bin/python benchmarks/auto_budget.py [--quick] [--repeats N] [--out out/auto_budget.json]

The benchmark lives in ``odb.bench.auto_budget`` (``make demo`` runs it as one of its sections);
this script runs it alone, with its options (``--help``).
"""

from odb.bench.auto_budget import main

if __name__ == "__main__":
    main()
