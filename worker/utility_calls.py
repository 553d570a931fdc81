"""UtilityCalls: runs the control stream's calls on the busy loop, which owns the engine.

After vLLM v1's `EngineCore` utility methods (reset_prefix_cache, sleep, wake_up, profile, and
its `load_lora_adapter` / `unload_lora_adapter`) and its `call_utility` dispatch: a call arrives
through the inbox (worker/control_listener.py), runs between two engine steps, and its
`ControlReply` goes back to the listener to be written. Any failure becomes an error answer; a
utility call never takes the worker down.

Sleep, as a queue worker does it: stop reading (entries stay with the consumer group, so its lag
still shows the work and KEDA still scales on it), stop reclaiming peers' entries, hand the
requests in flight back to peers at once (forgiven, like a drain's: no attempt is held against
them), then free the KV cache (level 2: the weights too). A sleeping worker keeps beating, shows
`sleeping` in its heartbeat and fails /readyz until `wake_up`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from llmq.protocol import METHODS, ControlCall, ControlReply

if TYPE_CHECKING:
    from llmq.worker.engine.lora.lora_manager import LoraManager
    from llmq.worker.engine_client import EngineClient
    from llmq.worker.inflight_table import InFlightTable
    from llmq.worker.lease_keeper import LeaseKeeper
    from llmq.worker.result_writer import ResultWriter

__all__ = ["Intake", "UtilityCalls"]

logger = logging.getLogger(__name__)


class Intake(Protocol):
    """The worker's taking of new work (reading its queue, reclaiming peers' entries), which a
    sleep pauses; worker/worker.py's `Worker` is the one implementation."""

    @property
    def draining(self) -> bool: ...

    def pause_intake(self) -> None:
        """Read and reclaim nothing more; a read blocking now is woken (on another thread)."""

    def resume_intake(self) -> None:
        """Read and reclaim again, unless the worker is draining."""


class UtilityCalls:
    """The calls, run on the busy loop: `engine` is the busy loop's; `table` the entries the
    worker holds; `writer` gets the outputs of the aborts a sleep makes; `keeper` hands entries
    back to peers; `intake` is paused while asleep."""

    def __init__(self, engine: EngineClient, table: InFlightTable, writer: ResultWriter,
                 keeper: LeaseKeeper, intake: Intake, *, worker_id: str,
                 model_name: str) -> None:
        self.engine = engine
        self.table = table
        self.writer = writer
        self.keeper = keeper
        self.intake = intake
        self.worker_id = worker_id
        self.model_name = model_name

    @property
    def sleep_level(self) -> int:
        return self.engine.sleep_level

    def run(self, call: ControlCall) -> ControlReply:
        handler = getattr(self, f"_{call.method}", None) if call.method in METHODS else None
        if handler is None:
            return self._reply(call, error=f"unknown method {call.method!r}: one of "
                                            f"{', '.join(METHODS)}")
        try:
            return self._reply(call, result=handler(**call.args))
        except TypeError as e:  # unexpected or missing args
            return self._reply(call, error=f"{call.method}: bad arguments {call.args}: {e}")
        except Exception as e:  # noqa: BLE001 - an answer, never a dead busy loop
            logger.exception("utility call %s failed", call.method)
            return self._reply(call, error=f"{call.method} failed: {e}")

    def _reply(self, call: ControlCall, result: dict[str, Any] | None = None,
               error: str | None = None) -> ControlReply:
        return ControlReply(call_id=call.call_id, worker=self.worker_id,
                            ok=error is None, result=result, error=error)

    # -- the calls ----------------------------------------------------------------------------

    def _reset_prefix_cache(self) -> dict[str, Any]:
        reset = self.engine.reset_prefix_cache()
        return {"reset": reset} if reset else {
            "reset": False, "reason": "requests are running and hold cached blocks"}

    def _sleep(self, level: int = 1) -> dict[str, Any]:
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        if self.sleep_level:
            return {"level": self.sleep_level, "already_sleeping": True}
        self.intake.pause_intake()
        handed_back = self.hand_back_in_flight()
        try:
            freed = self.engine.sleep(level)
        except Exception:
            self.intake.resume_intake()  # still awake: serve again rather than hang half asleep
            raise
        logger.warning("sleeping at level %d: %d MiB freed, %d request(s) handed back", level,
                       freed >> 20, len(handed_back))
        return {"level": level, "freed_bytes": freed, "handed_back": len(handed_back)}

    def _wake_up(self) -> dict[str, Any]:
        level = self.sleep_level
        if not level:
            return {"was_sleeping": 0}
        started = time.perf_counter()
        self.engine.wake_up()
        self.intake.resume_intake()
        logger.warning("awake after sleep level %d (%.2f s to restore)", level,
                       time.perf_counter() - started)
        return {"was_sleeping": level, "seconds": round(time.perf_counter() - started, 3)}

    def _profile(self, action: str, dir: str | None = None) -> dict[str, Any]:  # noqa: A002
        engine = self.engine
        if action == "start":
            engine.start_profile()
            return {"profiling": True}
        if action == "stop":
            folder = dir or os.environ.get("LLMQ_PROFILE_DIR") or tempfile.gettempdir()
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"llmq-trace-{self.worker_id}-"
                                        f"{int(time.time() * 1000)}.json")
            return {"profiling": False, "trace": engine.stop_profile(path)}
        raise ValueError(f"action must be start or stop, got {action!r}")

    def _load_lora(self, name: str) -> dict[str, Any]:
        loras = self._loras()
        started = time.perf_counter()
        adapter = loras.get(name)  # a LoraError names the adapter and the problem
        return {"name": name, "rank": adapter.rank, "loaded": loras.loaded(),
                "seconds": round(time.perf_counter() - started, 3)}

    def _unload_lora(self, name: str) -> dict[str, Any]:
        loras = self._loras()
        return {"name": name, "unloaded": loras.unload(name), "loaded": loras.loaded()}

    def _loras(self) -> LoraManager:
        if self.engine.loras is None:
            raise ValueError("this worker serves no LoRA adapters (it has no --lora-dir)")
        return self.engine.loras

    def _stats(self) -> dict[str, Any]:
        stats = dataclasses.asdict(self.engine.stats())
        return {**stats, "sleeping": self.sleep_level, "in_flight": len(self.table),
                "draining": self.intake.draining, "model": self.model_name}

    # -- sleeping -------------------------------------------------------------------------------

    def hand_back_in_flight(self) -> list[str]:
        """Give every request this worker holds back to its peers: fenced here (so nothing
        more is written for them and no ack happens), aborted in the engine, and handed back on
        another thread (the busy loop never waits on Redis)."""
        ids = self.table.live_entry_ids()
        every = self.table.entry_ids()  # with entries a peer took over, still in the engine
        if not every:
            return []
        self.table.fence(ids)
        self.engine.abort(every)
        # NOTE: one step delivers the aborts' outputs; the writer drops fenced entries' events
        # and forgets the entries.
        self.writer.put_step(self.engine.step())
        if ids:
            self.hand_back(ids)
        return ids

    def hand_back_admitted(self, entry_id: str) -> None:
        """An entry admitted while the worker fell asleep, never added to the engine."""
        self.table.fence([entry_id])
        self.table.pop(entry_id)
        self.hand_back([entry_id])

    def hand_back(self, ids: list[str]) -> None:
        """Hand entries back on another thread: the busy loop never waits on Redis."""
        threading.Thread(target=self.keeper.hand_back_retrying, args=(ids,),
                         kwargs={"forgive": True}, daemon=True,
                         name="llmq-sleep-hand-back").start()
