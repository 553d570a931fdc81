"""The file job's progress bar: its rate and ETA follow the workers' token counters while the job
runs, and end as the job's own tokens per second of wall time (no Redis)."""

from __future__ import annotations

import io

from rich.console import Console

from llmq.cli.progress import FileJobProgress
from llmq.protocol import WorkerHeartbeat


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class NoClient:
    """warn_if_unserved asks it for live workers: one serves the queue."""

    class settings:  # noqa: N801 - mimics Client.settings
        queue = "default"

    def workers(self) -> list[WorkerHeartbeat]:
        return [WorkerHeartbeat(worker_id="w1", queue="default")]


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


class Pool:
    """Two workers generating 300 tokens/s each, beating once a second, as heartbeats show."""

    class settings:  # noqa: N801 - mimics Client.settings
        queue = "default"

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.started = clock.now
        self.generating_since: float | None = None
        self.stopped_at: float | None = None

    def generated(self, at: float) -> int:
        if self.generating_since is None or at < self.generating_since:
            return 0
        end = at if self.stopped_at is None else min(at, self.stopped_at)
        return int((end - self.generating_since) * 300)

    def workers(self) -> list[WorkerHeartbeat]:
        beat = self.started + int(self.clock.now - self.started)  # the last whole second
        return [WorkerHeartbeat(worker_id=f"w{i}", queue="default",
                                heartbeat_ms=int(beat * 1000),
                                generated_tokens_total=1000 + self.generated(beat))
                for i in (1, 2)]


def test_rate_and_eta_are_right_from_the_first_seconds_though_results_come_in_waves() -> None:
    # Given 400 requests of 128 tokens on a pool of 600 tokens/s running 64 at a time, so
    # results land in waves of 64 every 13.65 s and the whole job takes 85.3 s
    clock, out = Clock(), io.StringIO()
    pool = Pool(clock)
    progress = FileJobProgress(pool, enabled=True, stream=out, clock=clock)
    progress.started(400, 0)
    progress.submitting(400)
    start = clock.now
    pool.generating_since = start + 0.5  # the first token
    wave_s, total_s = 64 * 128 / 600, 400 * 128 / 600
    done, rates, etas = 0, [], []
    while done < 400:
        clock.now += 0.25
        elapsed = clock.now - start
        while done < 400 and elapsed >= (done // 64 + 1) * wave_s \
                and (done // 64 + 1) * 64 <= 400:
            progress.advanced(done=64, tokens=64 * 128)
            done += 64
        if done < 400 and elapsed >= total_s:
            progress.advanced(done=400 - done, tokens=(400 - done) * 128)
            done = 400
        progress.tick()
        rates.append((elapsed, progress.rate()))
        if done >= 200 and not etas:
            etas.append((progress.eta_seconds(), total_s - elapsed))
    progress.stopped()
    # Then the rate is the pool's 600 tok/s within 5 s of the first token, long before the
    # first wave of results
    assert [r for t, r in rates if t <= 5.5 and r == "600 tok/s"]
    # And at half way the ETA is within 25% of the time really left
    eta, truth = etas[0]
    assert eta is not None and abs(eta - truth) <= 0.25 * truth, (eta, truth)


def test_the_pool_rate_ignores_idle_time_before_work_and_falls_when_work_stops() -> None:
    from llmq.cli.pool_rate import PoolTokenRate

    rate = PoolTokenRate("default")

    def beat(second: int, tokens: int) -> None:
        rate.observe([WorkerHeartbeat(worker_id="w", queue="default",
                                      heartbeat_ms=second * 1000,
                                      generated_tokens_total=tokens)])

    # Given a worker idle for 5 s, then generating 100 tokens/s from 5.5 s on
    for second in range(6):
        beat(second, 0)
    beat(6, 50)
    assert rate.tokens_per_s == 50  # one partial second: all there is to go by
    beat(7, 150)
    # Then the rate is 100 tok/s as soon as one whole busy second is seen
    assert rate.tokens_per_s == 100 and rate.tokens_since_start == 150
    # And when it stops, the idle seconds pull the rate down within the window
    beat(8, 250)
    for second in range(9, 14):
        beat(second, 250)
    assert rate.tokens_per_s is not None and rate.tokens_per_s < 50
    # And a worker of another queue is not counted
    rate.observe([WorkerHeartbeat(worker_id="x", queue="other", heartbeat_ms=1,
                                  generated_tokens_total=9)])
    assert rate.tokens_since_start == 250


def test_a_failed_heartbeat_read_leaves_the_bar_running() -> None:
    from llmq.cli.pool_rate import PoolTokenRate
    from llmq.protocol.errors import LLMQError

    def unreachable() -> list[WorkerHeartbeat]:
        raise LLMQError("Redis is away")

    rate = PoolTokenRate("default", read=unreachable)
    rate.poll()  # Then nothing is raised, and there is simply no figure yet
    assert rate.tokens_per_s is None and rate.tokens_since_start == 0
