"""The quick benchmark run that tests/bench's tests read (tests/support/quick_bench.py): once per session."""

import pytest

from quick_bench import QuickBench, run_quick_bench


@pytest.fixture(scope="session")
def quick_bench(tmp_path_factory) -> QuickBench:
    return run_quick_bench(tmp_path_factory.mktemp("bench"), tmp_path_factory.mktemp("checkout"))
