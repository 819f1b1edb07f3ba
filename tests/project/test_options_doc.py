"""docs/options.md is what scripts/make_options_doc.py makes of ODBConfig's docstring: an option added or
reworded in the code without regenerating the page fails here, and nothing hand-written in the page is
lost to the next regeneration."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_options_page_is_generated_from_the_config():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_options_doc.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
