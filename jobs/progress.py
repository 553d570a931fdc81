"""DatasetProgress: how far a dataset job is, per stage (rows, tokens/s, ETA), and its summary.

The job counts into it as rows move; whoever watches reads it whenever it likes: the CLI's
status line `line()`, the broker's job store (broker/job_progress.py) `record()`, and
`summary()` at the end. Rows an earlier run finished count as done but not toward the rates, so
a resumed job's ETA is about the work left.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from llmq.broker.job_progress import JobRecord, StageCounts

__all__ = ["DatasetProgress", "StageProgress"]


@dataclass
class StageProgress:
    name: str
    num_done: int = 0  # rows that finished this stage (ok or failed) in this run
    num_failed: int = 0
    num_skipped: int = 0  # rows its `when:` left out
    num_tokens: int = 0  # generated in this run
    num_running: int = 0  # requests of this stage queued or running now


@dataclass
class DatasetProgress:
    total_rows: int | None  # None: the source does not know
    stage_names: list[str]
    num_resumed: int = 0  # rows an earlier run wrote
    num_resumed_errors: int = 0  # of those, to the errors file
    num_written: int = 0  # rows this run wrote to the output or the errors file
    num_errors: int = 0  # of those, to the errors file (this run)
    num_duplicates: int = 0  # rows dedup dropped or flagged (this run and earlier ones)
    phase: str = "starting"  # starting, running, writing output, done
    started: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.time)  # unix s, for other hosts to read
    stages: dict[str, StageProgress] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.stages = {name: StageProgress(name) for name in self.stage_names}

    @property
    def elapsed(self) -> float:
        return max(time.monotonic() - self.started, 1e-6)

    def eta(self) -> float | None:
        """Seconds left at this run's rate, None when unknown."""
        if self.total_rows is None or self.num_written == 0:
            return None
        left = self.total_rows - self.num_resumed - self.num_written - self.num_duplicates
        return max(left, 0) * self.elapsed / self.num_written

    @property
    def num_done(self) -> int:
        """Rows in the output or the errors file, earlier runs' included."""
        return self.num_resumed + self.num_written

    @property
    def num_failed_rows(self) -> int:
        """Rows in the errors file, earlier runs' included."""
        return self.num_resumed_errors + self.num_errors

    def stage(self) -> str:
        """What the job waits on now: the first stage with requests out, else the phase."""
        for stage in self.stages.values():
            if stage.num_running and self.phase == "running":
                return stage.name
        return self.phase

    def record(self, job_id: str, name: str, *, state: str, runner: str, source: str,
               output: str, message: str = "") -> JobRecord:
        """The job's state for the broker's job store."""
        tokens = sum(stage.num_tokens for stage in self.stages.values())
        return JobRecord(
            id=job_id, name=name, state=state, stage=self.stage(), runner=runner,
            rows_done=self.num_done, rows_total=self.total_rows,
            rows_failed=self.num_failed_rows,
            duplicates=self.num_duplicates, tokens_per_s=round(tokens / self.elapsed, 1),
            eta_s=None if (eta := self.eta()) is None else round(eta, 1),
            started=self.started_at, source=source, output=output, message=message,
            stages=[StageCounts(name=s.name, done=s.num_done, failed=s.num_failed,
                                skipped=s.num_skipped, running=s.num_running,
                                tokens=s.num_tokens) for s in self.stages.values()])

    def line(self) -> str:
        done = self.num_done
        total = "?" if self.total_rows is None else str(self.total_rows)
        parts = [f"{done}/{total} rows"]
        for stage in self.stages.values():
            rate = stage.num_tokens / self.elapsed
            text = f"{stage.name}: {stage.num_done} done {rate:.0f} tok/s"
            if stage.num_failed:
                text += f" {stage.num_failed} failed"
            if stage.num_skipped:
                text += f" {stage.num_skipped} skipped"
            parts.append(text)
        eta = self.eta()
        if eta is not None:
            parts.append(f"ETA {_clock(eta)}")
        return " | ".join(parts)

    def summary(self, output: str, errors: str, num_rows: int, num_errors: int) -> str:
        """`num_rows` / `num_errors`: lines in the output and errors files, earlier runs' too."""
        tokens = sum(stage.num_tokens for stage in self.stages.values())
        text = (f"{num_rows} rows -> {output}, {num_errors} errors"
                + (f" -> {errors}" if num_errors else "")
                + (f", {self.num_duplicates} near-duplicates" if self.num_duplicates else "")
                + (f" ({self.num_resumed} rows done by an earlier run)" if self.num_resumed
                   else "")
                + f"; {tokens} tokens in {_clock(self.elapsed)}")
        for stage in self.stages.values():
            text += (f"\n  {stage.name}: {stage.num_done} rows, {stage.num_failed} failed, "
                     f"{stage.num_skipped} skipped, {stage.num_tokens} tokens")
        return text


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
