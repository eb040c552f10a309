"""The torch versions this template runs on: 2.11 (what cluster and vendor images often hold) to the newest one
tested (`make test-torch` at both ends, CI). Below that range every start is refused in one line; above it the
run goes on after one warning line. The pins `make train-local` installs (requirements.txt) lie inside it.

Standard library only: the launcher checks before it imports torch, from the installed package's metadata.
"""

from __future__ import annotations

import re
from importlib import metadata

from train.errors import ConfigError

TORCH_MIN = (2, 11)  # the oldest torch supported: README, Makefile's test-torch, .ci/run
TORCH_TESTED = (2, 15)  # the newest torch tested
PINS = "torch==2.14.1 torchvision==0.29.2"  # requirements.txt (tests/processes/test_torch_range.py keeps them equal)


def _text(version: tuple[int, int]) -> str:
    return ".".join(map(str, version))


def torch_version() -> str | None:
    """The installed torch's version as pip recorded it (None: no torch installed; importing it says so)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def check_torch(version: str | None = None) -> str | None:
    """None where the installed torch is in the supported range; a warning line where it is newer than the
    tested range. A torch below the range raises ConfigError (one line, exit 2), with the fix."""
    version = torch_version() if version is None else version
    found = re.match(r"(\d+)\.(\d+)", version or "")
    if not found:  # no torch, or a version of another form: left to torch's import
        return None
    have = int(found[1]), int(found[2])
    span = f"{_text(TORCH_MIN)} to {_text(TORCH_TESTED)}"
    if have < TORCH_MIN:
        raise ConfigError(f"torch {version} is older than this template supports ({span}): install the pins "
                          f"(pip install {PINS}), or a torch {_text(TORCH_MIN)} or newer with its torchvision "
                          f"(README: Keep the torch you have)")
    if have > TORCH_TESTED:
        return (f"warning: torch {version} is newer than the versions this template is tested with ({span}); "
                f"if something fails, install the pins: pip install {PINS}")
    return None
