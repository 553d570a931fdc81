"""The invariants a chaos soak (bench/chaos.py) checks of each accepted request's result stream.

docs/reliability.md, I1-I3: exactly one terminal event for the final attempt; that attempt's
deltas numbered 0..n-1 and concatenating to its text; nothing lost. Losses are allowed only
inside the AOF window before a Redis kill (`AofWindow`): with `appendfsync everysec` the
server may postpone writing to its AOF what it already answered, and a kill -9 loses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

from chaos_report import ChaosReport

from llmq import protocol


@dataclass
class AofWindow:
    seconds: float  # how long before a kill a write may be lost
    kills: list[float] = field(default_factory=list)  # unix times of kill -9

    def holds(self, at: float) -> bool:
        """Whether what was written at unix time `at` may have been lost with a kill."""
        return any(kill - self.seconds <= at <= kill for kill in self.kills)


def check_request(report: ChaosReport, rid: str, accepted_at: float,
                  timeline: list[tuple[int, protocol.Event]], window: AofWindow) -> None:
    """Count one request's outcome in `report`, with a violation for each invariant it breaks.
    `timeline`: its result stream as (server ms, event)."""
    r = report
    events = [event for _, event in timeline]
    if not events:
        return  # reported as unresolved already
    final = max(e.attempt for e in events)
    terminals = [e for e in events if protocol.is_terminal(e)]
    finals = [e for e in terminals if e.attempt == final]
    r.max_attempt = max(r.max_attempt, final)
    r.rerun += final > 1
    r.superseded_terminals += len(terminals) - len(finals)
    if len(finals) != 1:
        r.violations.append(f"{rid}: {len(finals)} terminal events for attempt {final}")
        return
    (terminal,) = finals
    assert isinstance(terminal, protocol.Done | protocol.Error)  # what is_terminal means
    r.outcomes["done" if isinstance(terminal, protocol.Done) else terminal.code] += 1
    ms = next(ms for ms, event in timeline if event is terminal)
    r.latencies.append(max(0.0, ms / 1000 - accepted_at))
    if isinstance(terminal, protocol.Error) and terminal.code == "lost_payload":
        # NOTE: the pool answered, but the request never ran: a loss unless Redis lost the
        # entry with its AOF suffix (nothing in the soak trims or deletes request entries).
        if window.holds(accepted_at):
            r.lost_in_window += 1
        else:
            r.lost_outside_window += 1
            r.violations.append(f"{rid}: lost_payload outside the AOF window")
    if isinstance(terminal, protocol.Done):
        deltas = [(at, e) for at, e in timeline
                  if isinstance(e, protocol.Delta) and e.attempt == final]
        seqs = [d.seq for _, d in deltas]
        if seqs == list(range(len(deltas))):
            if "".join(d.text for _, d in deltas) != terminal.text:
                r.violations.append(f"{rid}: deltas do not concatenate to the done text")
        elif _gaps_in_window(deltas, window):
            r.deltas_lost_in_window += len(set(range(seqs[-1] + 1)) - set(seqs))
        else:
            r.violations.append(f"{rid}: delta seqs {seqs}")


def _gaps_in_window(deltas: list[tuple[int, protocol.Delta]], window: AofWindow) -> bool:
    """Whether every run of missing deltas follows a delta written inside the AOF window of a
    kill (those after it were written too, then lost with the server's unflushed suffix), and
    none is missing at the start. Times are the result entries' (server ms)."""
    if not deltas or deltas[0][1].seq != 0:
        return False
    return all(window.holds(at / 1000) for (at, d), (_, nxt) in pairwise(deltas)
               if nxt.seq != d.seq + 1)
