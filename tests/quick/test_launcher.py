"""The launcher keeps torchrun's child-failed report back to the end."""
from __future__ import annotations

import io

import pytest

from train.launch.passthrough import Passthrough

CHILD_FAILED = """Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 386, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: {trailing}
============================================================
train FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 4321)
============================================================
""".format(trailing=" ")  # torchrun's line ends in a space


@pytest.mark.parametrize("usage", [False, True])
def test_torchrun_s_child_failed_report_is_kept_back_to_the_end_and_dropped_after_a_usage_error(usage):
    """The launcher decides at the end, once torchrun has ended and the markers are read: shown as it came (before
    what followed it) for a failure, dropped after a usage error, whose line says it all."""
    out = io.StringIO()
    passthrough = Passthrough(out)
    for line in ["before\n", *CHILD_FAILED.splitlines(keepends=True), "after\n"]:
        passthrough.feed(line)
    assert out.getvalue() == "before\n"
    passthrough.close(failed_workers=not usage)
    assert out.getvalue() == ("before\nafter\n" if usage else f"before\n{CHILD_FAILED}after\n"), out.getvalue()
