"""JobProgress: how far a dataset job is, per stage (rows, tokens/s, ETA), and its summary.

The job counts into it as rows move; whoever watches (the CLI's status line) reads `line()`
whenever it likes, and `summary()` at the end. Rows an earlier run finished count as done but
not toward the rates, so a resumed job's ETA is about the work left.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["JobProgress", "StageProgress"]


@dataclass
class StageProgress:
    name: str
    num_done: int = 0  # rows that finished this stage (ok or failed) in this run
    num_failed: int = 0
    num_skipped: int = 0  # rows its `when:` left out
    num_tokens: int = 0  # generated in this run


@dataclass
class JobProgress:
    total_rows: int | None  # None: the source does not know
    stage_names: list[str]
    num_resumed: int = 0  # rows an earlier run wrote
    num_written: int = 0  # rows this run wrote to the output or the errors file
    num_errors: int = 0  # of those, to the errors file (this run)
    num_duplicates: int = 0  # rows dedup dropped or flagged (this run and earlier ones)
    started: float = field(default_factory=time.monotonic)
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

    def line(self) -> str:
        done = self.num_resumed + self.num_written
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
