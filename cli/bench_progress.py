"""BenchProgress: `llmq bench`'s live bar on stderr, drawn with rich while the load runs.

    ━━━━━━━━━━━━━━━━━━━━━╺━━━━━━━━━━ 23/100  23%  1 failed  612 tok/s  0:07

The rate counts the tokens of the deltas the benchmark receives (it follows every request as a
client would), over the last 10 s, so it is live from the first token rather than from the first
finished request. On a terminal it is a rich live bar; elsewhere a plain line every 10 s, with no
control characters, so a log stays readable. The figures printed at the end are unchanged.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskProgressColumn,
    TimeElapsedColumn,
)
from rich.text import Text

__all__ = ["BenchProgress"]

WINDOW_S = 10.0
_PLAIN_INTERVAL = 10.0


class _FiguresColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(task.fields.get("figures", ""), style="cyan")


class BenchProgress:
    """Told of each token and each finished request; `tick()` (a few times a second) redraws."""

    def __init__(self, total: int, *, stream: TextIO | None = None,
                 console: Console | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.console = console
        self.tty = console.is_terminal if console is not None else self.stream.isatty()
        self.clock = clock
        self.tokens = self.done = self.failed = 0
        self._started = clock()
        self._samples: deque[tuple[float, int]] = deque([(self._started, 0)])
        self._drawn_at = self._started
        self._bar: Progress | None = None
        self._task: Any = None

    def token(self, count: int) -> None:
        self.tokens += count

    def finished(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok

    def rate(self) -> float:
        """Tokens per second over the last WINDOW_S (since the start, within the first)."""
        now = self.clock()
        then, tokens_then = self._samples[0]
        return (self.tokens - tokens_then) / (now - then) if now > then else 0.0

    def figures(self) -> str:
        failed = f"{self.failed} failed  " if self.failed else ""
        return f"{failed}{self.rate():.0f} tok/s"

    def line(self) -> str:
        elapsed = int(self.clock() - self._started)
        fraction = self.done / self.total if self.total else 1.0
        return (f"{self.done}/{self.total}  {fraction:4.0%}  {self.figures()}  "
                f"{elapsed // 60}:{elapsed % 60:02d}")

    def tick(self) -> None:
        now = self.clock()
        self._samples.append((now, self.tokens))
        while len(self._samples) > 2 and self._samples[1][0] <= now - WINDOW_S:
            self._samples.popleft()
        if self.tty:
            if self._bar is None:
                self._bar = Progress(BarColumn(bar_width=None), MofNCompleteColumn(),
                                     TaskProgressColumn(), _FiguresColumn(),
                                     TimeElapsedColumn(),
                                     console=self.console or Console(file=self.stream),
                                     get_time=self.clock, transient=True)
                self._task = self._bar.add_task("", total=self.total)
                self._bar.start()
            self._bar.update(self._task, completed=self.done, figures=self.figures())
        elif now - self._drawn_at >= _PLAIN_INTERVAL:
            self._drawn_at = now
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()  # transient: the final figures take its place
            self._bar = None
