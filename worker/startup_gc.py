"""startup_gc: no cyclic garbage collection while a worker imports torch and loads its model.

References: CPython's `gc.freeze` documentation (disable collection early, freeze the heap once
it is built, enable collection again); vLLM v1 `EngineCore` (`gc.freeze()` once the engine is
up, so later full collections skip the startup heap).

NOTE: a start makes ~280k objects (torch's modules, the model's) that live as long as the
process. CPython runs a full collection whenever the objects that survived the younger ones
grow by a quarter, so while they are being made it walks them again and again: ~0.2 s of a
1.4 s warm start (bench/load.py), one pass of ~0.1 s landing in the middle of the imports.
The cyclic garbage a start leaves is ~11k small objects (import-time functions, cells and
tuples; no arrays, cold or warm load alike), so it is frozen with the rest, not collected:
a full collection to free it would cost as much as one of the passes saved.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def startup_gc() -> Iterator[None]:
    """Collection off for the block; at its end every object made so far is frozen (moved
    where no collection walks it) and collection is on again, unless it was off before."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
