"""LoraError: an adapter that cannot be served, with a message that names it and the problem."""

from __future__ import annotations


class LoraError(ValueError):
    """Unknown, corrupt, for another base model, or above the maximum rank. The gate
    (worker/engine/input_processor.py) turns it into an invalid_request on the request's stream;
    the control stream's load_lora into an error reply."""
