"""ChaosReport: what a chaos soak (bench/chaos.py) counted, its invariants, and its table."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChaosReport:
    config: Any  # the ChaosConfig of the run
    fault_kinds: tuple[str, ...] = ()
    accepted: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # failed submits, by error
    faults: Counter[str] = field(default_factory=Counter)
    worker_exits: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)  # done / error code
    rerun: int = 0  # requests whose final attempt was > 1
    max_attempt: int = 0
    superseded_terminals: int = 0  # terminal events of lower attempts (allowed, dropped)
    lost_in_window: int = 0
    deltas_lost_in_window: int = 0  # streamed deltas Redis lost with its AOF suffix
    lost_outside_window: int = 0
    latencies: list[float] = field(default_factory=list)  # s from accept to final terminal
    pending_at_end: int = 0
    batches: dict[str, int] = field(default_factory=dict)  # --frontends: batches by final status
    violations: list[str] = field(default_factory=list)
    log_dir: str = ""

    @property
    def ok(self) -> bool:
        return not self.violations and self.lost_outside_window == 0 and not self.pending_at_end

    def table(self) -> str:
        c = self.config
        lat = sorted(self.latencies)
        pct = (lambda q: f"{lat[min(len(lat) - 1, int(q * len(lat)))]:.2f} s") if lat else \
            (lambda q: "-")
        rows = [
            ("run", f"{c.duration:g} s of faults, {c.workers} workers, {c.server}, seed {c.seed}"),
            ("requests accepted", f"{self.accepted} ({sum(self.refused.values())} refused: "
                                  f"{dict(self.refused) or 'none'})"),
            ("faults injected", ", ".join(f"{k} {self.faults[k]}" for k in self.fault_kinds)),
            ("worker exits", ", ".join(f"{k} {v}" for k, v in sorted(self.worker_exits.items()))
             or "none"),
            ("final outcomes", ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))),
            ("rerun (final attempt > 1)", f"{self.rerun} (highest attempt {self.max_attempt})"),
            ("superseded terminal events", str(self.superseded_terminals)),
            ("latency accept -> answer", f"p50 {pct(0.5)}, p99 {pct(0.99)}, max {pct(1.0)}"),
            ("lost in the AOF window", f"{self.lost_in_window} (resubmitted, finished, or "
                                       f"answered lost_payload); deltas "
                                       f"{self.deltas_lost_in_window} (the done text has them)"),
            ("lost outside it", str(self.lost_outside_window)),
            ("pending at the end", str(self.pending_at_end)),
            *([("batches (each custom_id once)", ", ".join(
                f"{k} {v}" for k, v in sorted(self.batches.items())) or "none")]
              if self.config.frontends else []),
            ("one terminal per final attempt", "PASS" if not any(
                "terminal" in v for v in self.violations) else "FAIL"),
            ("deltas concatenate to the text", "PASS" if not any(
                "delta" in v for v in self.violations) else "FAIL"),
            ("invariants", "PASS" if self.ok else f"FAIL: {self.violations[:5]}"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"| {'check'.ljust(width)} | result |", f"| {'-' * width} | --- |"]
        lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
        return "\n".join(lines)
