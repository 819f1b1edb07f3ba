"""The test tree mirrors src/odb: one folder per layer (plan, comm, data, epoch, resume, loader, train,
packed, integrations), plus bench/ (the benchmark's correctness) and project/ (docs, examples, the agent
skill). Shared code lives in support/: test helpers, the multi-process harness (dist_harness) and the
rank workers it runs, importable by name from every test (``from helpers import ...``).

Markers (deselect with ``-m "not slow"`` and so on):
  slow         long-running tests
  dist         real multi-process torch.distributed runs (gloo, one process per rank, forked from a server
               that imported torch and the frameworks once: tests/support/dist_harness.py)
  llamafactory LLaMA-Factory's real SFT trainer (fails where it does not import; skipped, saying so, on
               Python < 3.11, which it needs)
  trl          TRL's real SFTTrainer
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

MARKERS = {
    "slow": "long-running tests (deselect with -m 'not slow')",
    "dist": "real multi-process torch.distributed tests",
    "llamafactory": "runs LLaMA-Factory's real SFT trainer (fails where it does not import; skipped, saying so, "
                    "on Python < 3.11, which it needs)",
    "trl": "runs TRL's real SFTTrainer",
}


def pytest_configure(config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


@pytest.fixture(scope="session")
def quick_bench(tmp_path_factory):
    """`python -m odb.bench --quick` run once per session in a fresh copy of this checkout, for the tests of
    tests/bench that read its results (tests/support/quick_bench.py)."""
    from quick_bench import run_quick_bench

    return run_quick_bench(tmp_path_factory.mktemp("bench"), tmp_path_factory.mktemp("checkout"))
