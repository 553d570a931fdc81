"""How a part of the llmq function library (broker/functions.py) writes one of its functions: a
script body, as EVAL would run it, registered under a name. The parts (cache affinity's
hand-over, the consumer cleanup) are appended to the library by broker/functions.py."""

from __future__ import annotations

__all__ = ["script_function"]


def script_function(name: str, body: str) -> str:
    # NOTE: the bodies read KEYS and ARGV, as scripts do: the callback's parameters take those
    # names.
    return f"redis.register_function('{name}', function(KEYS, ARGV)\n{body}end)\n"
