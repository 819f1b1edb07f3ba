"""`python -m odb.bench --quick` run once per test session, in a fresh copy of this checkout (a git repository of
its own, every file committed), as `make demo` runs in a fresh clone: what it changes there is its own doing.
tests/conftest.py's ``quick_bench`` fixture hands it to the tests of tests/bench that read its results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The quick run takes about 2 minutes on 2 idle cores and 5-6 under a load of 8 (other test suites beside it);
# the tests that use it (the first one pays for it) get 1,500 s: above the run's own limit (1,200 s), so that
# a run too slow fails there, naming the run, not as a bare pytest timeout.
RUN_TIMEOUT_S = 1200
TEST_TIMEOUT_S = 1500


@dataclasses.dataclass
class QuickBench:
    """The run's output folder, its results file read, its stdout; the copy it ran in (None outside a git
    checkout), that copy's `git status` after the run, and the run's stderr (a pipe, as in a log)."""

    out: Path
    results: Dict[str, Any]
    stdout: str
    copy: Optional[str]
    status: Optional[str]
    stderr: str


def git(*args: str, cwd: str) -> str:
    proc = subprocess.run(["git", "-c", "user.name=odb-test", "-c", "user.email=odb-test@localhost", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"git {' '.join(args)}: {proc.stderr}"
    return proc.stdout


def fresh_copy(dest: str) -> "str | None":
    """The files of this checkout (tracked and new, not ignored, as they are now) committed in a new repository
    at ``dest``; None where the tests do not run from a git checkout."""
    try:
        listed = subprocess.run(["git", "-C", ROOT, "ls-files", "-co", "--exclude-standard", "-z"],
                                capture_output=True, text=True, timeout=60)
    except OSError:  # no git
        return None
    if listed.returncode != 0:
        return None
    for path in filter(None, listed.stdout.split("\0")):
        if os.path.isfile(os.path.join(ROOT, path)):  # not one deleted but not yet committed
            os.makedirs(os.path.dirname(os.path.join(dest, path)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, path), os.path.join(dest, path))
    git("init", "-q", cwd=dest)
    git("add", "-A", cwd=dest)
    git("commit", "-q", "--no-verify", "-m", "the checkout under test", cwd=dest)
    return dest


def run_quick_bench(out: Path, checkout: Path) -> QuickBench:
    """`python -m odb.bench --out <out> --quick` in a fresh copy of this checkout made at ``checkout``."""
    copy = fresh_copy(str(checkout))
    paths = [os.path.join(copy or ROOT, "src"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)))  # the copy's odb
    proc = subprocess.run([sys.executable, "-m", "odb.bench", "--out", str(out), "--quick"], env=env,
                          capture_output=True, timeout=RUN_TIMEOUT_S, cwd=copy or ROOT)  # where `make demo` runs
    # bytes, decoded here: text=True would read each '\r' of a progress bar as a newline
    stdout, stderr = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    status = git("status", "--porcelain", "--untracked-files=all", cwd=copy) if copy else None
    assert proc.returncode == 0, stderr[-3000:]
    with open(out / "results.json") as f:
        return QuickBench(out, json.load(f), stdout, copy, status, stderr)
