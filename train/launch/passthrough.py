"""torchrun's stderr, passed on line by line as the user should read it.

Everything passes, in order, but two kinds of traceback that are not news:
- torchrun's own SignalException (how it acknowledges a stop, sent to the launcher or to torchrun itself),
  and a rendezvous error the launcher's last line already explains (QUIET_TRACEBACK);
- a "--- Logging error ---" block that such a signal caused: torchrun's handler raises SignalException
  wherever its main thread stands, and a second stop signal (Ctrl-C reaches torchrun and the launcher;
  SLURM signals every process of the step) that lands inside one of torchrun's own log calls is caught by
  `logging`, which prints the whole stack, then goes on shutting down as before.

torchrun's own traceback when a worker failed (ChildFailedError, and the report of the failed workers that
follows it, the last thing torchrun says) is held back until the end of the stream, where the launcher says
whether to show it (close): not after a usage error of the workers, whose one line says it all, whether
torchrun ended on the launcher's SIGTERM or first on a rank that the error's rank left without its peer.
"""

from __future__ import annotations

import re
from typing import TextIO

from train.launch.verdict import QUIET_TRACEBACK

LOGGING_ERROR = "--- Logging error ---"
# How logging.Handler.handleError ends its block: the record, or why it could not be printed.
LOGGING_ERROR_END = ("Arguments: ", "Use the traceback above to help find the error.")
# The last line of torchrun's traceback when a worker failed; its report of the failures follows, between two
# lines of "=" (torch.distributed.elastic.multiprocessing.errors.ChildFailedError.format_msg).
CHILD_FAILED = re.compile(r"^(torch\.distributed\.\S*)?ChildFailedError\b")


class Passthrough:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.held: list[str] = []  # a traceback, kept back until its last line says what it is
        self.chained = False  # a dropped traceback's "The above exception ..." lines are dropped with it
        self.logging_error: list[str] | None = None  # a logging error block, kept back until its end
        self.failed: list[str] | None = None  # torchrun's ChildFailedError traceback and report, kept back to the end
        self.rules = 0  # the report's lines of "=" seen: it ends at the second
        self.after: list[str] = []  # what passes after it, kept back with it (in order)

    def feed(self, line: str) -> None:
        if self.failed is not None and self.rules < 2:
            self.failed.append(line)
            self.rules += line.startswith("=" * 20)
            return
        if self.logging_error is None and line.startswith(LOGGING_ERROR):
            self.logging_error = [line]
            return
        if self.logging_error is not None:
            self.logging_error.append(line)
            if line.startswith(LOGGING_ERROR_END) or len(self.logging_error) > 400:
                block, self.logging_error = self.logging_error, None
                if not any("SignalException" in text for text in block):
                    self._write(block)
            return
        if not self.held and line.startswith("Traceback (most recent call last):"):
            self.held.append(line)
            return
        if self.held:
            self.held.append(line)
            if line.startswith(" ") or not line.strip():  # (a traceback may hold an empty line)
                return
            if CHILD_FAILED.search(line):
                self.failed, self.held = self.held, []
                return
            quiet = "SignalException" in line or QUIET_TRACEBACK.search(line)
            lines, self.held, self.chained = ([] if quiet else self.held), [], bool(quiet)
        elif self.chained and (not line.strip() or line.startswith(("The above exception", "During handling"))):
            return
        else:
            lines, self.chained = [line], False
        self._write(lines)

    def close(self, failed_workers: bool = True) -> None:
        """At the end of the stream: whatever is still held back, as it came; torchrun's ChildFailedError traceback
        and report only with failed_workers (not where the launcher's last line says it all)."""
        self._write([*(self.logging_error or []), *self.held])
        failed, after = (self.failed or []) if failed_workers else [], self.after
        self.logging_error, self.held, self.failed, self.rules, self.after = None, [], None, 0, []
        self._write([*failed, *after])

    def _write(self, lines: list[str]) -> None:
        if self.failed is not None:
            self.after += lines
            return
        self.out.writelines(lines)
        self.out.flush()
