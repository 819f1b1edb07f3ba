"""`make demo` is a clean command: it runs the benchmark into out/ only, says where its tables
and plots are, and leaves publishing (README.md, docs/) to `make publish`; the benchmark draws
progress bars only on a terminal (a log gets plain progress lines, no redraws).

tests/bench/test_bench_smoke.py runs the benchmark itself (`python -m odb.bench --quick`) and checks
that the run changed no file of the checkout and wrote no carriage return to a piped stderr.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV = "/nonexistent-odb-venv"  # the dry run must not depend on (or build) the real .venv


def dry_run(target: str) -> list:
    """The commands ``make <target>`` would run (make -n), its virtual environment taken as built."""
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    proc = subprocess.run(["make", "-n", "--no-print-directory", f"VENV={VENV}", "-o", f"{VENV}/.odb-installed", target], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if line.strip()]


def test_make_demo_writes_under_out_only_and_says_where():
    # Before: make demo also ran scripts/update_readme.py, rewriting README.md and docs/benchmarks.md.
    commands = dry_run("demo")
    runs = [c for c in commands if not c.startswith("echo ")]
    assert runs == [f"{VENV}/bin/python -m odb.bench --out out/bench"], runs
    told = " ".join(c for c in commands if c.startswith("echo "))
    assert "out/bench/summary.md" in told and "out/bench/*.png" in told and "make publish" in told
    publish = " ".join(dry_run("publish"))  # publishing is its own target
    assert "scripts/update_readme.py docs/results/bench.json" in publish and "docs/results/bench.json" in publish


def test_what_make_demo_writes_is_ignored_by_git():
    """`make demo` writes out/bench/ (and may build .venv): git ignores both, so a fresh clone's `git status`
    stays clean after it (the smoke test runs the benchmark with --out elsewhere, so it cannot see this)."""
    import subprocess

    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    for path in ("out/bench/results.json", "out/bench/summary.md", "out/bench/bench.png", ".venv/bin/python"):
        proc = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT, timeout=60)
        assert proc.returncode == 0, f"{path} is not ignored by git: make demo would leave the checkout dirty"


def test_progress_bars_only_on_a_terminal(monkeypatch, tmp_path):
    # Before: tqdm bars whatever stderr was; a log of `make demo > log 2>&1` filled with redraws.
    from tqdm import tqdm

    from odb.bench.__main__ import _progress

    with open(tmp_path / "log", "w") as log:  # stderr sent to a file (a pipe is no terminal either)
        monkeypatch.setattr(sys, "stderr", log)
        items = list(range(10))
        assert list(_progress()(items, desc="x")) == items  # no bar: plain progress lines
    text = (tmp_path / "log").read_text()
    # Before: nothing at all for ~12 minutes of a log; now a few whole lines per loop, never a redraw
    assert "\r" not in text and text.splitlines() and all(line.startswith("[bench] x: ") for line in text.splitlines())
    assert len(text.splitlines()) <= 6 and "10/10" in text.splitlines()[-1]
    if not hasattr(os, "openpty"):
        return
    import fcntl
    import select
    import struct
    import termios

    main, terminal = os.openpty()
    try:
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        with open(terminal, "w") as tty:
            monkeypatch.setattr(sys, "stderr", tty)
            bar = _progress()([1, 2, 3], desc="x")
            assert isinstance(bar, tqdm) and list(bar) == [1, 2, 3]
            bar.close()
            tty.flush()
            chunks = []
            while select.select([main], [], [], 0.5)[0]:  # a read returns what one write put there: read all
                chunks.append(os.read(main, 4096))
            drawn = b"".join(chunks).decode(errors="replace")
        assert "\r" in drawn and "x: 100%" in drawn, repr(drawn)  # a bar, redrawn in place, on the terminal
    finally:
        os.close(main)
