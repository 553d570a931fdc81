"""`llmq bench`'s live bar: tokens per second from the deltas received, live from the first."""

from __future__ import annotations

import io

from rich.console import Console

from llmq.cli.bench_progress import BenchProgress


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_the_rate_is_live_before_any_request_finishes_and_follows_the_last_ten_seconds():
    # Given a benchmark of 10 requests receiving 200 tokens/s, none finished yet
    clock, out = Clock(), io.StringIO()
    progress = BenchProgress(10, stream=out, clock=clock)
    for _ in range(12):  # 3 s in ticks of 0.25 s
        clock.now += 0.25
        progress.token(50)
        progress.tick()
    # Then the rate already reads 200 tok/s
    assert progress.figures() == "200 tok/s"
    # And when the tokens slow to 40/s for 20 s, the rate is that within the window
    for _ in range(80):
        clock.now += 0.25
        progress.token(10)
        progress.tick()
    progress.finished(ok=True)
    progress.finished(ok=False)
    assert progress.figures() == "1 failed  40 tok/s"
    # And a log (not a terminal) got a plain line every 10 s, with no control characters
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("0/10") and "\x1b" not in out.getvalue()


def test_on_a_terminal_it_is_a_live_bar_that_makes_way_for_the_figures():
    clock, screen = Clock(), io.StringIO()
    console = Console(file=screen, force_terminal=True, width=70, color_system=None)
    progress = BenchProgress(4, console=console, clock=clock)
    clock.now += 1
    progress.token(30)
    progress.finished(ok=True)
    progress.tick()
    progress.stop()
    assert "1/4" in screen.getvalue() and "30 tok/s" in screen.getvalue()
