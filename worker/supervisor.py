"""Supervisor: the worker processes of `llmq up`, N `llmq worker` children on one machine.

Like foreman/honcho: children in the foreground with one prefixed, interleaved log, and a fixed
stop order. Workers get SIGTERM first (they stop reading, finish or hand back their requests,
write their last events), and the server is stopped only once they have exited, so nothing a
worker still wants to write is lost. Each child runs in a session of its own, so a Ctrl-C in the
terminal reaches only `llmq up`, which then stops them in that order.

Files under the run folder (next to the embedded server's redis.sock / redis.url / redis.pid):

    up.pid                 a foreground `llmq up` (so `llmq down` elsewhere can stop it)
    workers/<name>.pid     "<pid> <worker_id>" of each worker, foreground or detached
    logs/<name>.log        a detached worker's output
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import click

from llmq.broker.embedded import pid_alive

__all__ = ["Supervisor", "WorkerChild"]

_COLOURS = ("cyan", "green", "yellow", "magenta", "blue", "bright_cyan", "bright_green")


@dataclass
class WorkerChild:
    name: str  # worker-1, worker-2... (log prefix and pidfile name)
    worker_id: str  # the consumer name in Redis
    pid: int
    proc: subprocess.Popen[bytes] | None = None  # None: found through its pidfile
    pump: threading.Thread | None = field(default=None, repr=False)

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return pid_alive(self.pid, self.worker_id)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)


class Supervisor:
    def __init__(self, run_dir: Path, *, colour: bool | None = None) -> None:
        self.run_dir = run_dir
        self.workers_dir = run_dir / "workers"
        self.logs_dir = run_dir / "logs"
        self.up_pidfile = run_dir / "up.pid"
        self.colour = sys.stdout.isatty() if colour is None else colour
        self.children: list[WorkerChild] = []
        self._lock = threading.Lock()

    # -- logging ----------------------------------------------------------------------------------

    def log(self, name: str, message: str, colour: str = "white") -> None:
        prefix = f"{name:<9}|"
        if self.colour:
            prefix = click.style(prefix, fg=colour, bold=name == "llmq")
        with self._lock:
            click.echo(f"{prefix} {message}")

    def _pump(self, child: WorkerChild, colour: str) -> None:
        assert child.proc is not None and child.proc.stdout is not None
        for raw in child.proc.stdout:
            self.log(child.name, raw.decode(errors="replace").rstrip(), colour)

    # -- what is running --------------------------------------------------------------------------

    def foreground_pid(self) -> int | None:
        """The PID of a foreground `llmq up` using this run folder, if one runs."""
        try:
            pid = int(self.up_pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if pid != os.getpid() and pid_alive(pid, "llmq") else None

    def recorded_workers(self) -> list[WorkerChild]:
        """Workers found through their pidfiles that still run."""
        found = []
        for pidfile in sorted(self.workers_dir.glob("*.pid")):
            try:
                pid_text, worker_id = pidfile.read_text().split()
                child = WorkerChild(pidfile.stem, worker_id, int(pid_text))
            except (OSError, ValueError):
                continue
            if child.alive():
                found.append(child)
            else:
                pidfile.unlink(missing_ok=True)  # left by a killed `llmq up`
        return found

    # -- starting ---------------------------------------------------------------------------------

    def claim_foreground(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.up_pidfile.write_text(f"{os.getpid()}\n")

    def spawn_workers(self, count: int, worker_argv: Callable[[str], list[str]],
                      *, detach: bool) -> None:
        """Start `count` workers; `worker_argv(worker_id)` is each one's command line."""
        self.workers_dir.mkdir(parents=True, exist_ok=True)
        host = re.sub(r"[^A-Za-z0-9_.-]", "-", os.uname().nodename)[:40] or "host"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for i in range(1, count + 1):
            name = f"worker-{i}"
            worker_id = f"{host}-up{os.getpid()}-{i}"
            if detach:
                self.logs_dir.mkdir(parents=True, exist_ok=True)
                with open(self.logs_dir / f"{name}.log", "ab") as log:
                    proc = subprocess.Popen(worker_argv(worker_id), stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
            else:
                proc = subprocess.Popen(worker_argv(worker_id), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True)
            child = WorkerChild(name, worker_id, proc.pid, proc)
            (self.workers_dir / f"{name}.pid").write_text(f"{proc.pid} {worker_id}\n")
            if not detach:
                child.pump = threading.Thread(
                    target=self._pump, args=(child, _COLOURS[(i - 1) % len(_COLOURS)]),
                    name=f"log-{name}", daemon=True)
                child.pump.start()
            self.children.append(child)
            self.log(name, f"started pid {proc.pid} as {worker_id}", "white")

    def exited(self) -> list[WorkerChild]:
        return [c for c in self.children if not c.alive()]

    # -- stopping ---------------------------------------------------------------------------------

    def stop_workers(self, timeout: float, children: list[WorkerChild] | None = None) -> int:
        """SIGTERM every worker, wait up to `timeout` s, SIGKILL the rest; how many were running."""
        children = self.children if children is None else children
        running = [c for c in children if c.alive()]
        for child in running:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in running:
            while child.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if child.alive():
                self.log(child.name, f"did not stop within {timeout:g} s: killing it", "red")
                child.signal(signal.SIGKILL)
                if child.proc is not None:
                    child.proc.wait(10)
                else:
                    while child.alive():
                        time.sleep(0.05)
        for child in children:
            if child.proc is not None:
                child.proc.wait()
                code = child.proc.returncode
                if child.pump is not None:
                    child.pump.join(2)
                if child in running:
                    self.log(child.name, f"stopped (exit {code})", "white")
            (self.workers_dir / f"{child.name}.pid").unlink(missing_ok=True)
        return len(running)

    def release_foreground(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if int(self.up_pidfile.read_text().split()[0]) == os.getpid():
                self.up_pidfile.unlink()

    def stop_foreground(self, timeout: float) -> bool:
        """Ask a foreground `llmq up` elsewhere to stop (as Ctrl-C would); wait for it."""
        pid = self.foreground_pid()
        if pid is None:
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(pid, "llmq"):
            if time.monotonic() > deadline:
                raise click.ClickException(f"`llmq up` (pid {pid}) did not stop within "
                                           f"{timeout:g} s")
            time.sleep(0.1)
        return True
