"""Faults: env-gated fault hooks for the reliability tests. TEST-ONLY: never set in production.

`LLMQ_FAULT` holds comma-separated hooks (RELIABILITY.md section 6.3, "fault hooks"):

- `crash_after_terminal`      exit(9) after a terminal event is written but before its XACK
                              (scenario 2: the duplicate-terminal window of at-least-once).
- `raise_in_step`             every engine step raises (scenario 6: engine-fatal error).
- `raise_in_step:<text>`      a step raises while a request whose prompt (or any chat message)
                              contains <text> is in the engine: a deterministic poison request
                              (scenario 15).
- `slow_step:<ms>`            each engine step sleeps <ms> first, so tests can act mid-generation
                              with a tiny model that would otherwise finish in milliseconds.

With `LLMQ_FAULT` unset every hook is off and costs one attribute check.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENV = "LLMQ_FAULT"


class InjectedFault(RuntimeError):
    """Raised by the `raise_in_step` hook; the worker treats it like any engine failure."""


@dataclass
class Faults:
    crash_after_terminal: bool = False
    raise_in_step: bool = False
    raise_in_step_marker: str | None = None
    slow_step_s: float = 0.0

    @classmethod
    def from_env(cls, value: str | None = None) -> Faults:
        value = os.environ.get(ENV, "") if value is None else value
        faults = cls()
        for hook in filter(None, (h.strip() for h in value.split(","))):
            name, _, arg = hook.partition(":")
            if name == "crash_after_terminal":
                faults.crash_after_terminal = True
            elif name == "raise_in_step":
                if arg:
                    faults.raise_in_step_marker = arg
                else:
                    faults.raise_in_step = True
            elif name == "slow_step":
                faults.slow_step_s = float(arg) / 1000.0
            else:
                raise ValueError(f"{ENV}: unknown fault hook {hook!r}")
        if faults.active:
            logger.warning("TEST-ONLY fault hooks active: %s", value)
        return faults

    @property
    def active(self) -> bool:
        return (self.crash_after_terminal or self.raise_in_step
                or self.raise_in_step_marker is not None or self.slow_step_s > 0)

    def is_poison(self, texts: list[str]) -> bool:
        """Whether a request with these prompt texts trips `raise_in_step:<text>`."""
        marker = self.raise_in_step_marker
        return marker is not None and any(marker in t for t in texts)
