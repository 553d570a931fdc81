"""LibraryCheck: whether the llmq function library a worker acks through is on its server.

The worker's acks (`llmq_ack`) and lease renewals (`llmq_claim_owned`) are functions of the llmq
library (broker/functions.py), which the admin loads at deploy. The worker checks it when it
first reaches Redis, and again when Redis lost its data: where it is missing or older, it loads
it if its user may (no ACL, as on `llmq up`'s server), and otherwise says so once, in one line
that names the command to run, and takes no work (its readiness says the same) until it is
there; until then the worker checks again every reclaim round.
"""

from __future__ import annotations

import logging
from typing import Any

from llmq.broker.functions import FunctionLibraryMissing, ensure_functions

logger = logging.getLogger(__name__)


class LibraryCheck:
    def __init__(self, client: Any) -> None:
        self.client = client
        self.problem: str | None = None  # what is wrong with the library, as logged

    def check(self) -> bool:
        """Whether the library is there (loaded now if it was not and this user may); False,
        said once, when it is missing or older and this user may not load it."""
        try:
            ensure_functions(self.client)
        except FunctionLibraryMissing as exc:
            if self.problem != str(exc):
                logger.error("%s; this worker takes no work until then", exc)
            self.problem = str(exc)
            return False
        if self.problem is not None:
            logger.warning("the llmq function library is loaded now: taking work")
            self.problem = None
        return True
