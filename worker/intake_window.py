"""IntakeWindow: how many stream entries a worker may read now, so idle peers get the rest.

A consumer group hands each entry to whichever worker reads first. A worker that read up to
`max_num_seqs` at once would take a whole burst while its peers sat idle, the surplus waiting in
its engine's queue (seen: 61 of 64 requests on one of two workers, the other at 0 running). So a
worker reads only what its engine can start within about `STEPS_AHEAD` steps: the entries it
holds that have not started yet (admitted, or waiting in the engine for a token budget or KV
room) count against a window of `STEPS_AHEAD * max_num_batched_tokens / mean prompt length`
requests. The rest stays unread in the stream, where the group's lag shows it and an idle peer's
blocking read takes it. Entries start when the engine has produced their first token; a full KV
cache leaves them waiting, so a worker short of KV room reads nothing more either.

The mean starts from an assumed length that counts as `PRIOR_PROMPTS` prompts, so a few short
ones (a client's 8-token warm-ups) cannot open the window to every seat before a burst of long
ones.

A burst submitted at once (MULTI/EXEC, one pipeline) wakes every idle worker with one entry, and
each then reads the rest without blocking: the first to get there would take a whole window. So
each read takes at most an even share of the room among the pool's live workers (`per_read`);
what a busy peer leaves, the next read takes.

Lanes (broker/work_lanes.py): interactive entries are read first and see the whole window
(counting only the interactive entries that wait); batch entries fill what is left of it, and
never take the last `interactive_headroom` of the engine's seats, so an interactive request that
arrives while a batch backlog is being worked off finds a seat and is read at once
(`lane_rooms`).

Plain arithmetic over ints, shared by the admission thread (prompt lengths) and the stream
reader (room); no lock needed for the one float both touch.
"""

from __future__ import annotations

__all__ = ["IntakeWindow"]

# NOTE: two steps, not one: the next read is admitted while the engine runs the current step, so
# a worker with a full queue in the stream never runs a step with nothing new to prefill.
STEPS_AHEAD = 2
# A prompt length to plan with before the first request of this worker is tokenized.
ASSUMED_PROMPT_TOKENS = 256
# The assumed length weighs as much as this many prompts in the mean.
PRIOR_PROMPTS = 4
# Weight of the newest prompt in the running mean once it is past the prior (about the last 20
# prompts count).
SMOOTHING = 0.05
# The longest recent step fades by this factor a step (a long prefill step is remembered for
# a few dozen decode steps after it).
STEP_FADE = 0.95


class IntakeWindow:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int,
                 interactive_headroom: float = 0.0) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Seats batch work leaves free (at least one when there is any headroom at all, and
        # never all of them).
        self.headroom_seats = min(max_num_seqs - 1, max(
            1 if interactive_headroom > 0 else 0, round(max_num_seqs * interactive_headroom)))
        self.mean_prompt_tokens = float(ASSUMED_PROMPT_TOKENS)
        self._num_prompts = PRIOR_PROMPTS
        # Live workers in the pool (the lease keeper counts heartbeats); reads are shared by them.
        self.num_workers = 1
        self.longest_step_s = 0.0  # of the engine's recent steps

    def note_step(self, seconds: float) -> None:
        """The engine ran a step in `seconds` (the busy loop's thread)."""
        self.longest_step_s = max(seconds, self.longest_step_s * STEP_FADE)

    def note_prompt(self, num_tokens: int) -> None:
        """A request was tokenized at admission: its length updates the running mean (a plain
        mean with the prior at first, then one that follows a change of workload)."""
        self._num_prompts += 1
        weight = max(SMOOTHING, 1.0 / self._num_prompts)
        self.mean_prompt_tokens += weight * (max(1, num_tokens) - self.mean_prompt_tokens)

    @property
    def window(self) -> int:
        """Requests the engine can start within STEPS_AHEAD steps (at least one)."""
        mean_tokens = max(1, round(self.mean_prompt_tokens))  # in whole tokens, as prompts are
        startable = STEPS_AHEAD * self.max_num_batched_tokens / mean_tokens
        return max(1, min(self.max_num_seqs, int(startable)))

    def room(self, num_held: int, num_not_started: int) -> int:
        """Entries to read now, holding `num_held` entries of which `num_not_started` wait."""
        return max(0, min(self.max_num_seqs - num_held, self.window - num_not_started))

    def per_read(self, room: int) -> int:
        """Of `room` entries, how many one read takes: an even share among the live workers
        (at least one while there is room)."""
        return -(-room // max(1, self.num_workers)) if room > 0 else room

    def lane_rooms(self, num_held: int, num_not_started: int,
                   num_interactive_not_started: int) -> tuple[int, int]:
        """(interactive entries, batch entries) to read now. Interactive ones count only their
        own class's waiting entries against the window; batch ones all, and leave
        `headroom_seats` seats free."""
        seats = self.max_num_seqs - num_held
        interactive = min(seats, self.window - num_interactive_not_started)
        batch = min(seats - self.headroom_seats, self.window - num_not_started)
        return max(0, interactive), max(0, batch)
