"""The file job's progress bar: the rate it shows is tokens per second of wall time (no Redis)."""

from __future__ import annotations

import io

from rich.console import Console

from llmq.cli.progress import FileJobProgress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class NoClient:
    """warn_if_unserved asks it for live workers: one serves the queue."""

    class settings:  # noqa: N801 - mimics Client.settings
        queue = "default"

    def workers(self) -> list:
        class Worker:
            queue = "default"
        return [Worker()]


def run_job(progress: FileJobProgress, clock: Clock) -> None:
    """200 lines, 4,667 tokens, over 9 s: the run the issue reported."""
    progress.started(200, 0)
    progress.submitting(200)
    for i in range(200):
        clock.now += 9.0 / 200
        progress.advanced(done=1, tokens=4667 // 200 + (1 if i < 4667 % 200 else 0))
    progress.stopped()


def test_the_plain_line_shows_tokens_per_second_of_wall_time() -> None:
    # Given a log (not a terminal) and a job that generates 4,667 tokens in 9 s
    clock, out = Clock(), io.StringIO()
    progress = FileJobProgress(NoClient(), enabled=True, stream=out, clock=clock)
    run_job(progress, clock)
    # Then the last line says 519 tok/s (4667 / 9), with no control characters
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("200/200  100%") and "519 tok/s" in last and "\x1b" not in last
    # And the first line, written with the first result, already counted real time
    first = out.getvalue().splitlines()[0]
    assert first.startswith("1/200") and f"{24 / 0.045:.0f} tok/s" in first


def test_the_terminal_bar_fits_the_width_and_shows_the_same_rate() -> None:
    # Given a 60-column terminal
    clock, screen = Clock(), io.StringIO()
    console = Console(file=screen, force_terminal=True, width=60, color_system=None)
    progress = FileJobProgress(NoClient(), console=console, clock=clock)
    run_job(progress, clock)
    # Then the final frame shows the whole count and the true rate, within 60 columns
    frames = screen.getvalue().replace("\r", "\n").split("\n")
    final = [f for f in frames if "200/200" in f][-1]
    assert "519 tok/s" in final and "100%" in final
    assert all(console.measure(f).maximum <= 60 for f in frames if "tok/s" in f)


def test_a_resumed_job_counts_only_its_own_tokens_and_time() -> None:
    # Given 150 lines already written by an earlier run, and 50 more taking 5 s for 1,000 tokens
    clock, out = Clock(), io.StringIO()
    progress = FileJobProgress(NoClient(), enabled=True, stream=out, clock=clock)
    progress.started(200, 150)
    clock.now += 5.0
    progress.advanced(done=50, tokens=1000)
    progress.stopped()
    # Then the bar is full, the rate is 200 tok/s
    assert out.getvalue().splitlines()[-1].startswith("200/200  100%  200 tok/s")
