"""README reads in two minutes and every line of code in it runs.

- Under 150 lines; its first 60 hold the pitch, the plot, the install and the quickstart (its code included).
- Every ```python block is marked ``<!-- odb-snippet: NAME -->`` (tests/project/test_doc_snippets.py runs it as
  written) or names, on the line before it, the file that runs it.
- The plot it shows exists, and its figures are generated: the generated blocks sit between their markers, which
  scripts/update_readme.py rewrites from the results files (tests/bench/test_bench_smoke.py's
  ``test_published_figures_match_their_results_file`` checks they match).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
FILE_NAMED = re.compile(r"\[[^\]]*\]\(((?:examples|scripts|tests)/[^)]+\.py)\)|`((?:examples|scripts|tests)/[^`]+\.py)`")


def test_readme_is_short():
    assert len(README) < 150, f"README.md has {len(README)} lines: move detail to docs/ (the goal is < 150)"


def test_the_first_60_lines_hold_pitch_plot_install_and_quickstart():
    first = README[:60]
    assert first[0].startswith("# odb") and any("token budget" in line for line in first[1:8]), "the pitch"
    assert any(line.startswith("![") and "docs/img/loss_vs_time.png" in line for line in first), "the plot"
    for heading in ("## Install", "## Quickstart"):
        assert heading in first, f"{heading} is not in the first 60 lines"
    start = first.index("<!-- odb-snippet: readme-quickstart -->")
    assert "```" in first[start + 2:], "the quickstart's code ends after line 60"


def test_every_python_block_runs_or_names_the_file_that_runs_it():
    unmarked = []
    for i, line in enumerate(README):
        if line.strip() != "```python":
            continue
        marked = i > 0 and README[i - 1].startswith("<!-- odb-snippet: ")
        named = i > 0 and FILE_NAMED.search(README[i - 1])
        if not marked and not named:
            unmarked.append(i + 1)
        elif named and not marked:
            path = named.group(1) or named.group(2)
            assert (ROOT / path).exists(), f"README.md:{i + 1} names {path}, which does not exist"
    assert not unmarked, (f"README.md lines {unmarked}: a python block neither marked <!-- odb-snippet: NAME --> "
                          f"(run by tests/project/test_doc_snippets.py) nor naming the file that runs it")


def test_the_plot_exists_and_its_figures_are_generated():
    text = "\n".join(README)
    image = re.search(r"!\[[^\]]*\]\((docs/img/[\w.]+\.png)\)", text)
    assert image and (ROOT / image.group(1)).exists(), "README's plot is missing. Fix: make publish"
    for name in ("odb-plot", "odb-bench", "odb-times"):
        begin, end = f"<!-- {name}:begin", f"<!-- {name}:end -->"
        assert text.count(begin) == 1 and text.count(end) == 1, name
        assert text.index(begin) < text.index(image.group(1)) < text.index(end) or name != "odb-plot"
