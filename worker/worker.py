"""Worker: one EngineCore in a busy loop, with IO threads around it, serving one Redis queue.

After vLLM v1's `EngineCoreProc` (v1/engine/core.py): the main thread owns the engine and only
steps it; input and output IO run on other threads and meet the loop at FIFO queues, so Redis
round trips never stall a forward pass. Threads:

    StreamReader   XREADGROUP what fits -> Admission -> inbox          (worker/stream_reader.py)
    LeaseKeeper    heartbeat, renew + fence                            (worker/lease_keeper.py)
    Reclaimer      dead workers' and lapsed entries -> Admission       (worker/reclaimer.py)
    CancelListener cancel stream -> abort                              (worker/cancel_listener.py)
    ControlListener control stream -> utility calls -> answers         (worker/control_listener.py)
    busy loop      inbox -> EngineFeeder -> engine; step(); outputs -> ResultWriter
                   (the feeder: worker/engine_feeder.py; utility calls: worker/utility_calls.py)
    ResultWriter   events, EXPIRE, then XACK, in one MULTI per batch    (worker/result_writer.py)
    AffinityKeeper prefix summaries, hand-overs taken and stolen       (worker/affinity_keeper.py)

The threads share one `WorkerContext` (config, keys, connection factory, metrics, inbox,
in-flight table); the engine is anything that satisfies `EngineClient`.

Delivery is at-least-once (dramatiq/arq: ack only after the result is written). Lifecycle:

- SIGTERM/SIGINT: stop reading at once, let the engine finish in-flight work, then hand the
  rest back (XCLAIM IDLE <huge>: a peer's next scan takes it immediately; no ack, no terminal
  event) and exit 0, all within `drain_timeout` while Redis answers (the last second of it is
  kept for the exit). A second signal exits at once.
- An exception from `engine.step()` is engine-fatal: log it, hand every in-flight entry back,
  exit non-zero so peers (and the restarted pod) take the work. The entries that were in the
  engine go back as suspects, each to run alone on its next delivery (an `AddRequest.solo`
  waits for the engine to empty and nothing joins it), so only the request that kills engines
  is dead-lettered. Per-request problems never get this far: they are refused at admission or
  finish that request alone with an `error`.
- Redis loss: every thread retries with capped backoff; readiness is false meanwhile.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis

from llmq import protocol
from llmq.broker.commands import group_created, legacy_stream_message, queue_group_creation
from llmq.broker.keys import GROUP
from llmq.protocol.errors import StreamExhausted
from llmq.worker.admission import Admission
from llmq.worker.affinity_keeper import AffinityKeeper
from llmq.worker.backoff import TRANSIENT_ERRORS
from llmq.worker.cancel_listener import CancelListener
from llmq.worker.control_listener import ControlListener
from llmq.worker.engine.input_processor import InputProcessor
from llmq.worker.engine.sampling_params import SamplingParams
from llmq.worker.engine_client import EngineClient
from llmq.worker.engine_feeder import EngineFeeder
from llmq.worker.lease_keeper import LeaseKeeper
from llmq.worker.library_check import LibraryCheck
from llmq.worker.reclaimer import Reclaimer
from llmq.worker.request_spans import RequestSpans
from llmq.worker.result_writer import ResultWriter
from llmq.worker.stream_reader import StreamReader
from llmq.worker.utility_calls import UtilityCalls
from llmq.worker.worker_config import WorkerConfig
from llmq.worker.worker_context import WorkerContext
from llmq.worker.worker_status import WorkerStatus, start_observability

if TYPE_CHECKING:
    from llmq.worker.health_server import HealthServer
    from llmq.worker.metrics import WorkerMetrics

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ENGINE_FATAL = 70  # EX_SOFTWARE
# Seconds of the drain budget kept for the exit itself (flush, hand-back, threads, interpreter).
SHUTDOWN_RESERVE = 0.25


class Worker:
    def __init__(self, config: WorkerConfig, engine: EngineClient, *, model_name: str = "",
                 observability: tuple[WorkerMetrics | None, HealthServer | None] | None = None
                 ) -> None:
        self.config = config
        self.engine = engine
        self.model_name = model_name
        # NOTE: `llmq worker` starts the health server before loading the model (so /readyz
        # answers "loading model" meanwhile) and hands it over here.
        self.metrics, self.health = observability or start_observability(
            config.metrics_port, model_name, config.queue)
        self.ctx = ctx = WorkerContext(config, model_name, engine.config.max_num_seqs,
                                       self.metrics, engine.config.max_num_batched_tokens)
        ctx.spans = RequestSpans.for_process(config.queue, config.worker_id, model_name)
        self.keys, self.table, self.inbox, self.state = ctx.keys, ctx.table, ctx.inbox, ctx.state
        self.queue_key = ctx.queue_key
        self.writer = ResultWriter(ctx)
        self.processor = InputProcessor.for_engine(engine)
        self.admission = Admission(ctx, self.processor, self.writer, clock=engine.clock)
        self.admission.on_interactive = engine.step_interrupt.request
        self.admin = ctx.connect()
        self.keeper = LeaseKeeper(ctx, heartbeat=self._heartbeat_fields,
                                  ensure_group=self.ensure_group)
        self.reclaimer = Reclaimer(ctx, self.admission, self.writer, self.keeper.liveness,
                                   ensure_group=self.ensure_group,
                                   first_contact=self._first_contact)
        self.reader = StreamReader(ctx, self.admission, ensure_group=self.ensure_group,
                                   hand_back=self.keeper.hand_back)
        self.affinity = AffinityKeeper.attach(ctx, self.admission, self.reader, engine.config,
                                              self._accepting) if config.affinity else None
        self.cancels = CancelListener(ctx)
        self.controls = ControlListener(ctx)
        self.utility = UtilityCalls(engine, ctx.table, self.writer, self.keeper, self,
                                    worker_id=config.worker_id, model_name=model_name)
        self.feeder = EngineFeeder(engine, ctx.table, ctx.inbox, self.writer, self.utility,
                                   answer=self._answer)
        self.status = WorkerStatus(ctx, engine, self.metrics, self.health)
        self.draining = False
        self._drain_deadline = 0.0
        self._signals = 0
        self._stop_requested = False
        self._group_seen = False  # a group existed once: recreating it later is news
        # NOTE: no work is taken until the function library is there (it acks and renews
        # leases): the first contact with Redis checks it, and opens intake.
        self.library = LibraryCheck(self.admin)
        self._library_ready = False
        self.reader.pause()
        self.reclaimer.reclaiming = False
        self._engine_failed = False

    # -- lifecycle ---------------------------------------------------------------------------------

    def run(self, install_signal_handlers: bool = True) -> int:
        """Serve until stopped; returns the process exit code."""
        if install_signal_handlers:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        logger.info("worker %s serving %s (lease %.1f s, renew %.1f s, max_deliveries %d)",
                    self.config.worker_id, self.queue_key, self.config.lease_timeout,
                    self.config.renew_interval, self.config.max_deliveries)
        if not self._warm_up():
            return EXIT_ENGINE_FATAL
        self.writer.start()
        # NOTE: the followers find their streams' ends before the first heartbeat: a caller
        # that waits for the heartbeat and then sends a control call must not have it taken as
        # older than the worker (seen under load in tests/integration/test_worker_control.py).
        self.cancels.start()
        self.controls.start()
        self.keeper.start()
        self.reclaimer.start()
        for thread in (self.affinity, self.reader):
            if thread is not None:
                thread.start()
        exit_code = self._busy_loop()
        self._shutdown(exit_code)
        return exit_code

    def _warm_up(self) -> bool:
        """One short generation before serving: first-call allocations and lazy inits happen
        here, not in the first user's TTFT, and an engine that cannot run fails before it takes
        any work."""
        started = time.perf_counter()
        try:
            prompt = self.engine.tokenizer.encode("Hello") or [0]
            self.engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
        except Exception:  # noqa: BLE001 - nothing was taken yet: just do not start
            logger.exception("engine warm-up failed: not serving")
            return False
        logger.info("engine warmed up in %.2f s", time.perf_counter() - started)
        return True

    def request_stop(self) -> None:
        """What SIGTERM does: stop reading, drain for up to drain_timeout, hand back, exit.

        Safe in a signal handler and from any thread: it only sets a flag. NOTE: a handler runs
        on the main thread between two bytecodes, possibly while that thread holds a lock (the
        in-flight table's, or an Event's condition); anything that takes a lock here could
        deadlock the worker, so the busy loop does the rest (`_begin_drain`) within one
        iteration. Entries a read takes in that window are handed back, forgiven.
        """
        self._stop_requested = True

    def _begin_drain(self) -> None:
        if self.draining:
            return
        self.draining = True
        # NOTE: the budget covers the whole exit: the engine drains until SHUTDOWN_RESERVE
        # before its end, which leaves time to flush, hand back, unregister and join the
        # threads (a blocked XREAD ends within read_block_ms), so a platform that waits
        # drain_timeout before SIGKILL never kills a worker mid-hand-back.
        reserve = min(self.config.drain_timeout / 2,
                      SHUTDOWN_RESERVE + self.config.read_block_ms / 1000.0)
        self._drain_deadline = time.monotonic() + self.config.drain_timeout - reserve
        self.reader.stop_event.set()
        # NOTE: CLIENT UNBLOCK on a thread: the busy loop must not wait on Redis.
        threading.Thread(target=self.reader.stop, args=(self.admin,), daemon=True,
                         name="llmq-stop-reader").start()
        self.reclaimer.reclaiming = False
        if self.health is not None:
            self.health.set_draining()
        logger.warning("stopping: no new reads; draining %d in-flight request(s) for up to "
                       "%.1f s", self.table.running_count(), self.config.drain_timeout)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signals += 1
        if self._signals > 1:
            logger.error("second signal (%s): exiting now", signal.Signals(signum).name)
            os._exit(128 + signum)
        self.request_stop()

    def pause_intake(self) -> None:
        """Read and reclaim nothing more (a sleep); a read blocking now is woken."""
        self.reader.pause()
        self.reclaimer.reclaiming = False
        # NOTE: CLIENT UNBLOCK on a thread: the busy loop must not wait on Redis.
        threading.Thread(target=self.reader.unblock, args=(self.admin,), daemon=True,
                         name="llmq-pause-reader").start()

    def resume_intake(self) -> None:
        """Read and reclaim again (awake), unless draining (a drain's stop stands) or the
        function library is not there yet."""
        if not self.draining and self._library_ready:
            self.reclaimer.reclaiming = True
            self.reader.resume()

    def _accepting(self) -> bool:
        """Whether this worker takes new work (cache affinity hands it none otherwise)."""
        return not (self._stop_requested or self.draining) and self.reader.awake.is_set()

    def ensure_group(self) -> None:
        """Create the consumer group (at id 0, with the stream) if it does not exist."""
        # NOTE: the group is gone with every entry we held (a Redis restart without
        # persistence): those entries have no lease to renew any more, but still run.
        self.table.orphan_all()
        self.ctx.lanes.groups_lost()  # the lanes' groups went the same way: made again too
        pipe = self.admin.pipeline(transaction=False)
        queue_group_creation(pipe, self.keys, self.config.queue)
        try:
            created = group_created(pipe.execute(raise_on_error=False), self.keys,
                                    self.config.queue)
        except StreamExhausted as exc:
            # NOTE: keep serving: what is pending or unread still runs, which is the fix's
            # first step; only new submissions fail (with this message).
            logger.error("%s", exc)
            created = False
        if created:
            logger.log(logging.WARNING if self._group_seen or len(self.table) else logging.INFO,
                       "created consumer group %s on %s", GROUP, self.queue_key)
        self._group_seen = True
        self.library.check()

    def _first_contact(self) -> bool:
        """Once Redis answers: refuse to run beside a v1 queue; take work once the function
        library is there. True when done; called again every reclaim round until then."""
        if self.admin.exists(self.keys.legacy_queue(self.config.queue)):
            logger.error("%s: stopping", legacy_stream_message(self.keys, self.config.queue))
            self.request_stop()
            return True
        if not self.library.check():
            return False
        self._library_ready = True
        self.resume_intake()
        return True

    # -- the busy loop ----------------------------------------------------------------------------

    def _busy_loop(self) -> int:
        engine = self.engine
        need_step = False  # an abort's `cancelled` output comes from the next step
        next_stats = 0.0
        while True:
            if self._stop_requested and not self.draining:
                self._begin_drain()
            busy = engine.has_unfinished_requests() or need_step
            need_step |= self.feeder.drain_inbox(block=0.0 if busy else 0.05)
            now = time.monotonic()
            if now >= next_stats:
                next_stats = now + 0.25
                self._publish_stats()
                if dead := self._dead_threads():
                    logger.error("IO thread(s) %s died (see the traceback above): handing "
                                 "in-flight work back and exiting", dead)
                    return EXIT_ENGINE_FATAL
            if self.draining and self._drained(now):
                return EXIT_OK
            if engine.has_unfinished_requests() or need_step:
                need_step = False
                try:
                    self._step()
                except Exception:  # noqa: BLE001 - engine-fatal: peers must take the work
                    logger.exception("engine step failed: handing in-flight work back and "
                                     "exiting")
                    self._engine_failed = True
                    return EXIT_ENGINE_FATAL

    def _dead_threads(self) -> list[str]:
        """IO threads that ended on an unexpected exception (they only end when told to)."""
        alive: dict[str, Callable[[], bool]] = {
            "result writer": self.writer.is_alive, "lease keeper": self.keeper.is_alive,
            "reclaimer": self.reclaimer.is_alive, "cancel listener": self.cancels.is_alive,
            "control listener": self.controls.is_alive}
        if self.affinity is not None:
            alive["affinity keeper"] = self.affinity.is_alive
        if not self.draining:
            alive["stream reader"] = self.reader.is_alive
        return [name for name, is_alive in alive.items() if not is_alive()]

    def _drained(self, now: float) -> bool:
        if now >= self._drain_deadline:
            left = self.table.running_count()
            if left:
                logger.warning("drain budget of %.1f s spent: handing back %d unfinished "
                               "request(s)", self.config.drain_timeout, left)
            return True
        return (not self.engine.has_unfinished_requests() and self.inbox.empty()
                and not self.feeder.num_held and not self.reader.is_alive()
                and self.table.running_count() == 0)

    def _answer(self, reply: protocol.ControlReply) -> None:
        """A utility call's reply, once readiness shows the call's effect."""
        self._publish_stats()
        self.controls.answer(reply)

    def _step(self) -> None:
        started = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - started
        if not outputs:
            return
        self.ctx.intake.note_step(elapsed)
        num_tokens = sum(len(output.new_token_ids) for output in outputs)
        # NOTE: a child of an n > 1 request is `<entry id>#<index>`; its entry has started.
        self.table.mark_started([output.request_id.partition("#")[0] for output in outputs
                                 if output.new_token_ids])
        self.status.num_generated += num_tokens
        self.writer.put_step(outputs)
        if self.metrics is not None:
            self.metrics.observe_step(elapsed, num_tokens)

    # -- shutdown ---------------------------------------------------------------------------------

    def _shutdown(self, exit_code: int) -> None:
        self.reader.stop()
        self.reclaimer.reclaiming = False
        self.cancels.stop()
        self.controls.stop()
        self.reader.join(self.config.read_block_ms / 1000.0 + 1.0)
        flushed = self.writer.stop(self.config.flush_timeout)
        # NOTE: renewals stop before the hand-back, or one could reset the huge IDLE to 0.
        self.reclaimer.stop()
        if self.affinity is not None:
            self.affinity.stop()
        self.keeper.stop()
        left = self.table.live_entry_ids()
        if left:
            # NOTE: a drain's hand-back is no failure of the request. After an engine failure
            # the requests that were in the engine are suspects: their delivery counts, and each
            # runs alone next time; those it never had are as innocent as a drain's.
            suspects = [e for e in left if self._engine_failed
                        and getattr(self.table.get(e), "in_engine", False)]
            innocent = [e for e in left if e not in set(suspects)]
            if innocent:
                self._log_hand_back(self.keeper.hand_back_retrying(
                    innocent, forgive=exit_code == EXIT_OK or self._engine_failed), False)
            if suspects:
                self._log_hand_back(self.keeper.hand_back_retrying(
                    suspects, forgive=False, suspect=True), True)
        self._unregister()
        self.cancels.join(self.config.read_block_ms / 1000.0 + 1.0)
        self.controls.join(self.config.read_block_ms / 1000.0 + 1.0)
        if self.health is not None:
            self.health.stop()
        logger.warning("worker %s stopped (exit %d, %d entr%s handed back, events %s)",
                       self.config.worker_id, exit_code, len(left),
                       "y" if len(left) == 1 else "ies", "flushed" if flushed else "NOT flushed")

    @staticmethod
    def _log_hand_back(n: int | None, suspect: bool) -> None:
        if n is not None:
            logger.warning("handed back %d in-flight entr%s for peers to take now%s", n,
                           "y" if n == 1 else "ies",
                           " (suspects: each runs alone next)" if suspect else "")

    def _unregister(self) -> None:
        try:
            pipe = self.admin.pipeline(transaction=False)
            pipe.delete(self.keys.worker(self.config.worker_id))
            pipe.zrem(self.keys.workers(), self.config.worker_id)
            pipe.execute()
        except (redis.RedisError, *TRANSIENT_ERRORS):  # type: ignore[misc]
            pass  # the heartbeat expires by itself

    # -- observability ----------------------------------------------------------------------------

    def _publish_stats(self) -> None:
        """Snapshot engine state for the heartbeat thread; beat and refresh readiness."""
        sleeping = self.utility.sleep_level
        self.status.publish(self.affinity, f"sleeping (level {sleeping})" if sleeping
                            else self.library.problem)

    def _heartbeat_fields(self) -> dict[str, str]:
        """Called by the lease keeper every renewal."""
        return self.status.heartbeat_fields(self.draining, self.utility.sleep_level)
