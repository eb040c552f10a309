"""The supported torch range is the README's, CI's and the pins'."""
from __future__ import annotations

import re

from tests.conftest import ROOT
from train import supported


def test_the_range_is_the_one_the_readme_states_ci_tests_and_the_pins_lie_in():
    low, high = (".".join(map(str, v)) for v in (supported.TORCH_MIN, supported.TORCH_TESTED))
    readme = (ROOT / "README.md").read_text()
    assert f"torch {low} to {high}" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    tested = re.findall(r"make test-torch TORCH=(\d+)\.(\d+)\.\d+", ci)
    assert sorted({(int(a), int(b)) for a, b in tested}) == [supported.TORCH_MIN, supported.TORCH_TESTED], tested
    pins = re.findall(r"^(torch(?:vision)?==\S+)$", (ROOT / "requirements.txt").read_text(), re.M)
    assert " ".join(pins) == supported.PINS
    assert supported.check_torch(pins[0].split("==")[1]) is None
    # the README's install that keeps the torch an environment holds is the one `make test-torch` runs
    keep = re.search(r"^KEEP_TORCH_INSTALL = (.+)$", (ROOT / "Makefile").read_text(), re.M)[1]
    assert keep.replace(" -q", "") in readme
