"""Every guide's snippet runs as written, on the pinned versions, offline, with a tiny model.

Every fenced ``python`` block of README.md and of docs/integration-guides/*.md sits right under a
line ``<!-- odb-snippet: NAME -->`` and is run unchanged: each in a fresh interpreter (this file, run as a
script), in an empty working folder, after the fixture ``NAME`` (tests/support/snippet_fixtures.py) has
put there the names the snippet assumes and does not build itself (``model``, ``tokenizer``, ``dataset``,
``collate_fn``, a ``my_sft.yaml``...: a tiny random Llama, a word-level tokenizer trained on
generated sentences, no download). The fixture then checks what the snippet did (it trained:
finite loss, parameters changed) and that odb raised none of its warnings about silent
mistakes (a forgotten ``pop_step_info``, labels that need ``shift_labels``). Multi-process
snippets run in one process here; tests/project/test_examples.py runs the examples on two. A block
that is not run is listed in ``NOT_RUN`` with the reason, and the test says so.

    python tests/project/test_doc_snippets.py NAME FILE LINE   # what each test runs
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
import snippet_fixtures  # noqa: E402

GUIDES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "integration-guides").glob("*.md"))
MARK = re.compile(r"^<!-- odb-snippet: ([\w-]+) -->\s*$")
# Python blocks left unmarked on purpose, by (guide, the block's first code line), with the reason.
NOT_RUN: Dict[Tuple[str, str], str] = {}


@dataclass(frozen=True)
class Snippet:
    name: str
    path: str
    line: int  # of the first code line
    code: str


def snippets(path: str) -> List[Snippet]:
    """The marked ```python blocks of ``path`` (relative to the repository root)."""
    lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines):
        mark = MARK.match(line)
        if not mark:
            continue
        if i + 1 >= len(lines) or lines[i + 1].strip() != "```python":
            raise ValueError(f"{path}:{i + 1}: the odb-snippet mark must sit on the line right above a ```python "
                             f"fence. Fix: move it there.")
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
        out.append(Snippet(mark.group(1), path, i + 3, "\n".join(lines[i + 2:end]) + "\n"))
    return out


FIXTURES = snippet_fixtures.FIXTURES  # tests/support/snippet_fixtures.py: what each snippet assumes


def run(name: str, path: str, line: int) -> None:
    """Build fixture ``name``, run the snippet of ``path`` at ``line`` unchanged, check what it did."""
    from odb.loader.batch_checks import ShiftLabelsWarning
    from odb.step_info import StepInfoNotPoppedWarning

    snippet = next(s for s in snippets(path) if s.line == line)
    namespace, check = FIXTURES[name]()
    namespace["__name__"] = "__main__"
    with warnings.catch_warnings():
        for silent_mistake in (StepInfoNotPoppedWarning, ShiftLabelsWarning):
            warnings.simplefilter("error", silent_mistake)
        exec(compile(snippet.code, f"{path}:{line}", "exec"), namespace)
    check(namespace)
    print(f"snippet {name} of {path}:{line} ran")


def python_blocks(path: str) -> List[Tuple[int, str]]:
    """Every ```python block of ``path``: (the line of its fence, its first code line)."""
    lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
    return [(i + 1, lines[i + 1].strip() if i + 1 < len(lines) else "") for i, line in enumerate(lines)
            if line.strip() == "```python"]


# ---- the tests -----------------------------------------------------------------------------------------------
ALL = [s for path in GUIDES for s in snippets(path)]


def test_every_python_block_of_every_guide_is_run_and_every_mark_has_a_fixture():
    marked = {(s.path, s.line - 1) for s in ALL}  # the line of each marked block's fence
    unmarked = [(path, line, first) for path in GUIDES for line, first in python_blocks(path)
                if (path, line) not in marked and (path, first) not in NOT_RUN]
    assert not unmarked, ("python blocks no test runs (put <!-- odb-snippet: NAME --> right above each and a "
                          f"fixture NAME in tests/support/snippet_fixtures.py): {unmarked}")
    listed = {(path, first) for path in GUIDES for _, first in python_blocks(path)}
    assert set(NOT_RUN) <= listed, f"NOT_RUN names blocks that are gone: {set(NOT_RUN) - listed}"
    names = [s.name for s in ALL]
    assert len(set(names)) == len(names) and set(names) == set(FIXTURES), (names, sorted(FIXTURES))
    for (path, first), why in NOT_RUN.items():
        print(f"NOT RUN: the python block of {path} starting {first!r}: {why}")


# ---- versions: pinned in constraints*.txt, shown in docs/versions.md, linked from the guides ------------------------
PACKAGES = {"transformers": "transformers", "accelerate": "accelerate", "lightning": "lightning", "trl": "trl",
            "datasets": "datasets", "torch": "torch", "peft": "peft", "llama-factory": "llamafactory",
            "llamafactory": "llamafactory"}
VERSION = re.compile(r"\b(transformers|accelerate|lightning|trl|datasets|torch|peft|llama-factory|llamafactory)"
                     r"(?:'s)?`?\s*(==|>=|<=|<|>)?\s*(\d+\.\d+(?:\.\d+)?)\b", re.IGNORECASE)
# A transformers 5.x version wherever a guide names it (the package's name need not precede it).
TRANSFORMERS = re.compile(r"(?<![\d.])5\.\d+(?:\.\d+)?(?![\d.]*e)(?!\d)")
TESTED_WITH = re.compile(r"\btested (?:with|on|at)\s+[`\w]*\s*\d+\.\d+")  # a guide links versions.md instead
# Versions a guide names that are no pin and no bound of odb's: what another package declares, or a fact about a
# release, each with the reason it stays.
OTHER_VERSIONS = {("transformers", "5.6.0"): "LLaMA-Factory's declared newest transformers, run by hand",
                  ("transformers", "5.6"): "the same",
                  ("transformers", "5.3.0"): "5.3.0-5.5.3 divide the loss twice: enable_odb refuses them",
                  ("transformers", "5.5.3"): "the same", ("transformers", "5.5.4"): "the first without it",
                  ("transformers", "5.17"): "5.5.4-5.17 cannot resume a checkpoint of several CPU processes"}


def pins() -> Dict[str, set]:
    """Every version of each package that odb pins (constraints*.txt) or declares (pyproject.toml)."""
    found: Dict[str, set] = {}
    for path in sorted(ROOT.glob("constraints*.txt")):
        for line in path.read_text(encoding="utf-8").splitlines():
            name, sep, version = line.split("#")[0].strip().partition("==")
            if sep:
                found.setdefault(name.strip().lower(), set()).add(version.strip())
    for name, version in re.findall(r'"([a-z-]+)>=([\d.]+)', (ROOT / "pyproject.toml").read_text(encoding="utf-8")):
        found.setdefault(name, set()).add(version)
    return found


def test_the_guides_name_only_pinned_or_declared_versions():
    """A version a guide names for a package is a pin of constraints*.txt (the version tested, shown in
    docs/versions.md), a bound pyproject.toml declares, a bound LLaMA-Factory declares (<=), or listed above."""
    known, wrong = pins(), []

    def named(package: str, version: str) -> bool:
        return any(v == version or v.startswith(version + ".") for v in known.get(package, ())) or \
            (package, version) in OTHER_VERSIONS

    for path in GUIDES[1:]:
        text = (ROOT / path).read_text(encoding="utf-8")
        for n, line in enumerate(text.splitlines(), 1):
            for name, op, version in VERSION.findall(line):
                if not (named(PACKAGES[name.lower()], version) or op == "<="):
                    wrong.append(f"{path}:{n}: {name} {op}{version}")
            wrong += [f"{path}:{n}: transformers {v}" for v in TRANSFORMERS.findall(line)
                      if not named("transformers", v) and "<=" + v not in line]
        wrong += [f"{path}: {m!r} (link docs/versions.md instead)" for m in TESTED_WITH.findall(" ".join(text.split()))]
    assert not wrong, f"versions that are no pin (constraints*.txt) and no declared bound: {wrong}"


def test_versions_md_shows_the_pins():
    """docs/versions.md's table: the floors column is constraints-min.txt, the newest column constraints.txt."""
    table = {}
    for line in (ROOT / "docs" / "versions.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 4:
            table[cells[0].lower()] = cells
    newest = {line.split("==")[0]: line.split("==")[1].strip() for line in
              (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines() if "==" in line}
    floors = {line.split("==")[0]: line.split("==")[1].strip() for line in
              (ROOT / "constraints-min.txt").read_text(encoding="utf-8").splitlines() if "==" in line}
    for name in ("torch", "transformers", "accelerate", "lightning", "datasets"):
        assert table[name][2].startswith(floors[name]), (name, table[name], floors[name])
        assert table[name][3].startswith(newest[name]), (name, table[name], newest[name])
    assert table["trl"][3].startswith(newest["trl"])
    lf = dict(line.split("==") for line in (ROOT / "constraints-llamafactory.txt").read_text().split() if "==" in line)
    assert table["llama-factory"][3].startswith(lf["llamafactory"])


def test_the_mark_must_sit_right_above_a_python_fence(tmp_path, monkeypatch):
    import pytest

    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "guide.md").write_text("<!-- odb-snippet: x -->\n\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="right above a ```python fence"):
        snippets("guide.md")
    (tmp_path / "guide.md").write_text("text\n<!-- odb-snippet: x -->\n```python\na = 1\nb = 2\n```\n")
    assert snippets("guide.md") == [Snippet("x", "guide.md", 4, "a = 1\nb = 2\n")]


def _test(snippet: Snippet) -> Callable[[Any], None]:
    import pytest

    marks = [pytest.mark.timeout(300)]
    if snippet.name.startswith("llamafactory"):
        marks.append(pytest.mark.llamafactory)
        marks.append(pytest.mark.skipif(sys.version_info < (3, 11), reason=(
            "LLaMA-FACTORY SNIPPET NOT RUN: LLaMA-Factory 0.9.5 needs Python >= 3.11 (make test-min runs 3.10); "
            "`make test` runs it on Python 3.11")))
    if snippet.name.startswith("trl"):
        marks.append(pytest.mark.trl)

    def test(tmp_path: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests" / "support")]),
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "WANDB_DISABLED": "true"}
        env.pop("DISABLE_VERSION_CHECK", None)  # what a user's shell holds: the integration deals with it
        proc = subprocess.run([sys.executable, __file__, snippet.name, snippet.path, str(snippet.line)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
        assert proc.returncode == 0, (f"the snippet of {snippet.path}:{snippet.line} fails as written:\n"
                                      f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        assert f"snippet {snippet.name} of {snippet.path}:{snippet.line} ran" in proc.stdout

    for mark in marks:
        test = mark(test)
    test.__name__ = f"test_snippet_runs_as_written[{snippet.name}]"
    return test


for _snippet in ALL:
    globals()[f"test_snippet_{_snippet.name.replace('-', '_')}_runs_as_written"] = _test(_snippet)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]))
