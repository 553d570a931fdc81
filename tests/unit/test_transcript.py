"""The attempt rule readers follow: newest attempt wins, its start drops earlier partial text."""

from __future__ import annotations

from llmq.broker.transcript import Fold, Transcript
from llmq.protocol import Delta, Done, Error, Start, Timings, Usage


def _done(attempt: int, text: str) -> Done:
    return Done("r", attempt, "stop", text, Usage(3, 2), Timings(0.1, 0.2, 0.3, 0.05))


def test_deltas_assemble_the_text_and_done_ends_it() -> None:
    transcript = Transcript("r")
    events = [Start("r", 1, "w1", 3), Delta("r", 1, 0, "Hel", [1]), Delta("r", 1, 1, "lo", [2])]
    for event in events:
        assert transcript.apply(event) is Fold.ACCEPTED
    assert transcript.text == "Hello" and not transcript.finished
    assert transcript.apply(_done(1, "Hello")) is Fold.ACCEPTED
    assert transcript.finished and transcript.final == _done(1, "Hello")


def test_a_newer_attempt_drops_the_partial_text_of_the_older_one() -> None:
    # Given attempt 1 wrote some text, then its worker died and a peer re-ran it
    transcript = Transcript("r")
    transcript.apply(Start("r", 1, "w1", 3))
    transcript.apply(Delta("r", 1, 0, "partial ", [1]))
    # When attempt 2 starts
    fold = transcript.apply(Start("r", 2, "w2", 3))
    # Then the reader is told to drop what it showed, and only attempt 2's text remains
    assert fold is Fold.RESTARTED
    assert transcript.text == "" and transcript.num_restarts == 1
    transcript.apply(Delta("r", 2, 0, "whole", [5]))
    # And late writes of the stale attempt (its worker did not know yet) are ignored
    assert transcript.apply(Delta("r", 1, 1, "stale", [2])) is Fold.IGNORED
    assert transcript.apply(_done(1, "partial stale")) is Fold.IGNORED
    assert transcript.apply(_done(2, "whole")) is Fold.ACCEPTED
    assert transcript.text == "whole" and transcript.final.attempt == 2


def test_an_error_of_a_newer_attempt_without_a_start_supersedes_too() -> None:
    # Given a request dead-lettered as poison by a reclaimer after attempt 3 died mid-way
    transcript = Transcript("r")
    transcript.apply(Start("r", 3, "w", 3))
    transcript.apply(Delta("r", 3, 0, "a", [1]))
    poison = Error("r", 4, "poison", "delivered 4 times")
    assert transcript.apply(poison) is Fold.RESTARTED
    assert transcript.final == poison and transcript.text == ""


def test_a_gap_in_seq_marks_the_text_truncated_but_done_is_whole() -> None:
    # Given a reader that arrives after MAXLEN trimmed the first entries
    transcript = Transcript("r")
    transcript.apply(Delta("r", 1, 7, "tail", [1]))
    assert transcript.truncated
    transcript.apply(_done(1, "head ... tail"))
    assert transcript.text == "head ... tail"


def test_a_re_read_delta_is_not_applied_twice_and_nothing_follows_the_end() -> None:
    transcript = Transcript("r")
    transcript.apply(Delta("r", 1, 0, "a", [1]))
    assert transcript.apply(Delta("r", 1, 0, "a", [1])) is Fold.IGNORED
    transcript.apply(_done(1, "a"))
    assert transcript.apply(Start("r", 2, "w", 1)) is Fold.IGNORED
    assert transcript.text == "a"
