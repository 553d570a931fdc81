"""Progress: the one-line progress bar of file and batch jobs, on stderr.

    ██████████████░░░░░░░░░░  23/40  57%  2 failed  412 tok/s  ETA 0:07

Redrawn in place (at most 10 times a second) when stderr is a terminal; elsewhere (a log file,
CI) a plain line every 10 seconds, so logs stay readable. The rates count only this run's work,
not the results a resumed run found already done.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 24


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total: int, *, already_done: int = 0, enabled: bool | None = None,
                 stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.enabled = self.tty if enabled is None else enabled
        self.total = total
        self.done = already_done
        self.failed = 0
        self.tokens = 0
        self._base = already_done
        self._started = time.monotonic()
        self._drawn_at = 0.0
        self._interval = 0.1 if self.tty else 10.0

    def update(self, *, done: int = 0, failed: int = 0, tokens: int = 0) -> None:
        self.done += done
        self.failed += failed
        self.tokens += tokens
        now = time.monotonic()
        if self.enabled and now - self._drawn_at >= self._interval:
            self._drawn_at = now
            self._draw(final=False)

    def close(self) -> None:
        if self.enabled:
            self._draw(final=True)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self._started, 1e-6)
        fraction = self.done / self.total if self.total else 1.0
        filled = int(fraction * _WIDTH)
        parts = ["█" * filled + "░" * (_WIDTH - filled), f"{self.done}/{self.total}",
                 f"{fraction:4.0%}"]
        if self.failed:
            parts.append(f"{self.failed} failed")
        parts.append(f"{self.tokens / elapsed:.0f} tok/s")
        new = self.done - self._base
        left = self.total - self.done
        if left and new:
            parts.append(f"ETA {_clock(elapsed / new * left)}")
        elif not left:
            parts.append(f"in {_clock(elapsed)}")
        return "  ".join(parts)

    def _draw(self, final: bool) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()
