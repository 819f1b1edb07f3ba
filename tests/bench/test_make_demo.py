"""`make demo` and `make bench` are clean commands: each runs the benchmark into out/ only (the demo its headline
at reduced sizes into out/demo, the full run into out/bench), says where its tables and plots are, and leaves
publishing (README.md, docs/) to `make publish`; the demo opens with what it runs and what it leaves out and
ends with a one-screen summary and its plots; the benchmark draws progress bars only on a terminal (a log gets
plain progress lines, no redraws).

tests/bench/test_bench_smoke.py runs the full benchmark itself (`python -m odb.bench --quick`) and checks
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
    # Before: make demo also ran scripts/update_readme.py, rewriting README.md and docs/benchmarks.md; then it ran
    # the whole benchmark (39 min on 2 cores) before a newcomer saw anything.
    assert dry_run("demo") == [f"{VENV}/bin/python -m odb.bench --demo --out out/demo"]
    bench = dry_run("bench")
    assert [c for c in bench if not c.startswith("echo ")] == [f"{VENV}/bin/python -m odb.bench --out out/bench"]
    assert "make publish" in " ".join(bench)
    publish = " ".join(dry_run("publish"))  # publishing is its own target, from make bench's run
    assert "scripts/update_readme.py docs/results/bench.json" in publish and "cp out/bench/results.json" in publish
    assert "out/demo/results.json docs/results/demo.json" in publish  # the demo's time only


def test_the_demo_runs_the_full_sections_at_reduced_sizes():
    """The demo's sections are make bench's (the same code, model, data, cap and learning rate), smaller: its
    convergence arms are arms of the full section, its scale cells cells of the full grid."""
    from odb.bench import scale
    from odb.bench.convergence import ARMS, SIZES
    from odb.bench.demo import DEMO_CONVERGENCE, DEMO_SCALE, plan_lines

    full, demo = SIZES["full"], DEMO_CONVERGENCE["size"]
    assert set(DEMO_CONVERGENCE["arms"]) <= set(ARMS) and {"fixed", "odb_padded", "odb_packed"} <= set(
        DEMO_CONVERGENCE["arms"])
    assert demo["workload"] == full["workload"] and demo["accumulations"] == full["accumulations"]
    assert all(demo[k] <= full[k] for k in ("samples", "epochs", "rounds", "extra_epochs"))
    assert set(DEMO_SCALE["worlds"]) <= set(scale.WORLDS) and set(DEMO_SCALE["shares"]) <= set(scale.SHARES)
    assert 1024 in DEMO_SCALE["worlds"] and set(DEMO_SCALE["arms"]) <= set(scale.ARMS)
    said = " ".join(plan_lines())
    assert "no spread" in said and "make bench" in said  # the output says what it leaves out


@pytest.mark.timeout(600)
def test_the_demo_opens_with_what_it_runs_and_ends_with_the_summary_and_its_plots(tmp_path):
    """``python -m odb.bench --demo --quick`` (the demo's arms at the smoke test's tiny sizes): the plan first, the
    one-screen summary and every plot's path last; make publish refuses its results."""
    import subprocess

    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "odb.bench", "--demo", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=560, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("make demo: the benchmark's headline at reduced sizes")
    assert lines[1].startswith("- convergence:") and lines[2].startswith("- scale:")
    start = next(i for i, line in enumerate(lines) if line.startswith("== summary of make demo"))
    screen = lines[start:]
    assert len(screen) <= 30, "the summary does not fit one screen"
    assert any("convergence, 2 ranks, A = 8" in line for line in screen)
    plots = [line.split(": ", 1)[0].strip() for line in screen if line.startswith("  ") and ".png: " in line]
    assert {os.path.basename(p) for p in plots} == {"loss_vs_time.png", "training_loss.png", "scale.png"}
    assert all(os.path.exists(p) for p in plots)
    assert (out / "summary.md").exists() and "== Goals" not in proc.stdout  # the tables go to summary.md
    refused = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "update_readme.py"),
                              str(out / "results.json"), "--readme", str(tmp_path / "README.md"), "--no-docs",
                              "--allow-quick"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert refused.returncode == 2 and "make demo" in refused.stderr


def test_what_make_demo_writes_is_ignored_by_git():
    """`make demo` and `make bench` write out/demo/ and out/bench/ (and may build .venv): git ignores them, so a
    fresh clone's `git status` stays clean after them (the smoke test runs the benchmark with --out elsewhere, so it
    cannot see this)."""
    import subprocess

    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    for path in ("out/bench/results.json", "out/bench/summary.md", "out/bench/bench.png", "out/demo/results.json",
                 "out/demo/loss_vs_time.png", ".venv/bin/python"):
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
