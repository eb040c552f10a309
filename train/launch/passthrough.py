"""torchrun's stderr, passed on line by line as the user should read it.

Everything passes, in order, but two kinds of traceback that are not news:
- torchrun's own SignalException (how it acknowledges a stop, sent to the launcher or to torchrun itself),
  and a rendezvous error the launcher's last line already explains (QUIET_TRACEBACK);
- a "--- Logging error ---" block that such a signal caused: torchrun's handler raises SignalException
  wherever its main thread stands, and a second stop signal (Ctrl-C reaches torchrun and the launcher;
  SLURM signals every process of the step) that lands inside one of torchrun's own log calls is caught by
  `logging`, which prints the whole stack, then goes on shutting down as before.
"""

from __future__ import annotations

from typing import TextIO

from train.launch.verdict import QUIET_TRACEBACK

LOGGING_ERROR = "--- Logging error ---"
# How logging.Handler.handleError ends its block: the record, or why it could not be printed.
LOGGING_ERROR_END = ("Arguments: ", "Use the traceback above to help find the error.")


class Passthrough:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.held: list[str] = []  # a traceback, kept back until its last line says what it is
        self.chained = False  # a dropped traceback's "The above exception ..." lines are dropped with it
        self.logging_error: list[str] | None = None  # a logging error block, kept back until its end

    def feed(self, line: str) -> None:
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
            quiet = "SignalException" in line or QUIET_TRACEBACK.search(line)
            lines, self.held, self.chained = ([] if quiet else self.held), [], bool(quiet)
        elif self.chained and (not line.strip() or line.startswith(("The above exception", "During handling"))):
            return
        else:
            lines, self.chained = [line], False
        self._write(lines)

    def close(self) -> None:
        """At the end of the stream: whatever is still held back, as it came."""
        self._write([*(self.logging_error or []), *self.held])
        self.logging_error, self.held = None, []

    def _write(self, lines: list[str]) -> None:
        self.out.writelines(lines)
        self.out.flush()
