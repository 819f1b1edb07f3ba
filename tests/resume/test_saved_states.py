"""States saved by earlier odb versions still resume exactly (fixtures: tests/resume/state_fixtures.py).

Each fixture is a state saved mid-epoch by the version in its name, with the rest of that epoch as the
uninterrupted loader made it; today's loader, built with the same arguments, loads the old state and must
make exactly that rest."""

from __future__ import annotations

import json

import pytest

from odb.resume.state import OLDEST_VERSION, STATE_VERSION
from state_fixtures import CASES, STATES, make, records

FIXTURES = sorted(STATES.glob("v*_*.json"))


def test_every_case_has_fixtures_of_every_version_this_odb_loads():
    versions = {path.name.split("_")[0] for path in FIXTURES}
    assert versions == {f"v{v}" for v in range(OLDEST_VERSION, STATE_VERSION + 1)}
    assert {path.stem.split("_", 1)[1] for path in FIXTURES} == set(CASES)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_a_saved_state_resumes_the_rest_of_its_epoch(path):
    saved = json.loads(path.read_text())
    loader, step = make(saved["case"])
    loader.load_state_dict(saved["state"])
    assert records(loader, step) == saved["rest"]
