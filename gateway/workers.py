"""``kvscope gateway --workers N``: N gateway processes serving one port, under one supervisor.

Why: one Python process relays at most one core's worth of tokens (docs/gateway.md "CPU per relayed token");
in front of a GPU replica the gateway needs more.

How the port is shared: the supervisor binds N listening sockets to ``host:port``, each with ``SO_REUSEPORT``,
and hands socket ``i`` to worker ``i`` (an inherited descriptor; the worker serves it with uvicorn). The
kernel spreads new connections over the N sockets by a hash of their addresses, so a client that opens 32
keep-alive connections at once gets about 16 on each of 2 workers. One socket shared by every worker
(gunicorn's and uvicorn's own ``--workers``) leaves the choice to whichever process wakes first, and an
asyncio or libuv server accepts every pending connection per wake-up, so such a burst can land on a single
worker. Because the supervisor, not the worker, owns each socket, a worker that stops (reload, crash) leaves
its socket open: connections waiting in its queue are served by the worker started in its place, never reset
(which is what happens when a process that bound its own ``SO_REUSEPORT`` socket exits). Before binding, the
supervisor checks that the port is free with a plain bind, so a second gateway on the same port fails at once
instead of joining the group and taking half the traffic.

What the workers share (docs/gateway.md "Several worker processes"):

- rate limits: through Redis (``redis_url``); settings refuse N > 1 with in-memory limits, which are per
  process (gateway/settings.py ``GatewaySettings.rate_limited``);
- ``/metrics``: prometheus_client's multiprocess mode, in a fresh folder the supervisor creates and removes
  (``$PROMETHEUS_MULTIPROC_DIR`` for the workers); any worker answers a scrape with every worker's series
  (gateway/metrics_workers.py); the supervisor marks an exited worker dead for the library;
- the request log file: appended by every worker under a file lock (gateway/logs/sinks.py ``shared``); each
  record names its worker in ``process.pid``;
- the console: off (it would show the process that answers its page);
- Elasticsearch: each worker ships its own records, spooling to ``<spool_dir>/worker-<index>``.

Signals: SIGTERM or SIGINT stop the gateway gracefully: every worker stops accepting, finishes its requests
in flight (open streams run to their end, for at most ``timeouts.total_s``) and exits; a second one makes the
workers quit without waiting (uvicorn's force exit). SIGHUP reloads: the configuration is read again (host,
port and ``workers`` keep their values until a restart) and each worker is replaced in turn by a new one on
the same socket: the new one is ready before the old one is told to stop, and the old one drains its
streams. A worker that exits on its own is started again (after 1 s); one that exits before it ever became
ready (a bad tokenizer path, an upstream client that cannot start) stops the gateway with status 1.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvscope.gateway.settings import MULTIPROC_DIR_ENV, GatewaySettings, SettingsSource

_log = logging.getLogger("kvscope.gateway")

READY = b"r"
"""What a worker writes to its ready pipe once it serves (its lifespan has started)."""
READY_TIMEOUT_S = 120.0
"""Longest start of one worker (its first health round and scrape of the upstreams included)."""
RESTART_DELAY_S = 1.0
"""Wait before starting again a worker that exited on its own."""
BACKLOG = 2048
"""Listen backlog of each socket (uvicorn's default)."""
WORKER_MODULE = "kvscope.gateway.worker_main"


@dataclass(slots=True)
class _Worker:
    index: int
    popen: subprocess.Popen
    ready_fd: int
    """Read end of the worker's ready pipe (closed once read)."""
    ready: bool = False


@dataclass(slots=True)
class _Signals:
    stops: int = 0
    """SIGTERM/SIGINT received."""
    reloads: int = 0
    """SIGHUP received and not handled yet."""
    pending: list[int] = field(default_factory=list)


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` listening TCP sockets on ``host:port``, each with ``SO_REUSEPORT`` (port 0: the port the
    first one got). Raises OSError naming the address when the port is taken (checked first with a plain
    bind: a socket group of another process would otherwise accept ours)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is not taken
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            sock.listen(BACKLOG)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class WorkerSupervisor:
    """Starts, watches, reloads and stops the workers of one gateway (module docstring).

    ``argv``: the ``kvscope gateway`` arguments, given to every worker as they are (each loads the same
    settings); ``settings``: what they load to now (host, port, ``workers``, ``timeouts.total_s``)."""

    def __init__(self, argv: Sequence[str], settings: GatewaySettings, source: SettingsSource) -> None:
        self.argv = list(argv)
        self.settings = settings
        self.source = source
        self.workers: dict[int, _Worker] = {}
        """Worker index → the process serving socket ``index`` now."""
        self.retiring: list[_Worker] = []
        """Replaced workers still draining their requests (reload)."""
        self.sockets: list[socket.socket] = []
        self.metrics_dir: Path | None = None
        self._signals = _Signals()

    @property
    def count(self) -> int:
        return self.settings.workers

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; returns 0 after a requested stop, 1 when a worker could not start or
        the port is taken."""
        try:
            self.sockets = bind_sockets(self.settings.host, self.settings.port, self.count)
        except OSError as exc:
            print(f"kvscope gateway: {exc.strerror or exc}", file=sys.stderr)
            return 1
        self.metrics_dir = Path(tempfile.mkdtemp(prefix="kvscope-gateway-metrics-"))
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        }
        try:
            return self._serve()
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for sock in self.sockets:
                sock.close()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _serve(self) -> int:
        for index in range(self.count):
            self.workers[index] = self._spawn(index)
        for worker in list(self.workers.values()):
            if not self._wait_ready(worker):
                return 0 if self._signals.stops else 1  # a stop asked for during the start is no failure
        pids = ", ".join(str(w.popen.pid) for w in self.workers.values())
        # the supervisor configures no logging (its errors reach stderr through logging's last resort): its
        # start-up line is printed, as its other messages
        print(
            f"kvscope gateway: {self.count} workers on {self.settings.host}:{self.port} (pids {pids})",
            file=sys.stderr,
            flush=True,
        )
        while not self._signals.stops:
            if self._signals.reloads:
                self._signals.reloads = 0
                self._reload()
            if not self._watch():
                return 1
            time.sleep(0.1)
        return 0

    @property
    def port(self) -> int:
        return self.sockets[0].getsockname()[1] if self.sockets else self.settings.port

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGHUP:
            self._signals.reloads += 1
            return
        self._signals.stops += 1
        if self._signals.stops > 1:  # a second stop: the workers quit without draining
            self._signal_all(signal.SIGINT)

    def command(self, index: int, ready_fd: int) -> list[str]:
        """The command of worker ``index``: ``python -P -m kvscope.gateway.worker_main`` with its slot, its
        socket's and ready pipe's descriptors, then the gateway's own arguments."""
        return [
            sys.executable,
            "-P",
            "-m",
            WORKER_MODULE,
            f"--index={index}",
            f"--count={self.count}",
            f"--socket-fd={self.sockets[index].fileno()}",
            f"--ready-fd={ready_fd}",
            "--",
            *self.argv,
            f"--workers={self.count}",  # the last one wins: the file's value cannot change it on a reload
        ]

    def _spawn(self, index: int) -> _Worker:
        read_fd, write_fd = os.pipe()
        env = {**os.environ, MULTIPROC_DIR_ENV: str(self.metrics_dir)}
        try:
            popen = subprocess.Popen(  # noqa: PLW1509 - preexec_fn: pdeathsig and a process group
                self.command(index, write_fd),
                pass_fds=(self.sockets[index].fileno(), write_fd),
                env=env,
                preexec_fn=_worker_preexec,
            )
        finally:
            os.close(write_fd)
        return _Worker(index, popen, read_fd)

    def _wait_ready(self, worker: _Worker) -> bool:
        """Wait until ``worker`` reports ready (True), exits or times out (False, with a message)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._signals.stops:
            left = deadline - time.monotonic()
            if left <= 0:
                print(
                    f"kvscope gateway: worker {worker.index} not ready after {READY_TIMEOUT_S:.0f} s",
                    file=sys.stderr,
                )
                return False
            readable, _, _ = select.select([worker.ready_fd], [], [], min(left, 0.2))
            if readable:
                data = os.read(worker.ready_fd, 1)
                os.close(worker.ready_fd)
                worker.ready_fd = -1
                if data == READY:
                    worker.ready = True
                    return True
                code = worker.popen.wait()
                print(
                    f"kvscope gateway: worker {worker.index} exited with code {code} before it was ready",
                    file=sys.stderr,
                )
                return False
        return False

    def _watch(self) -> bool:
        """Handle exited workers: a retired one is done, a serving one is started again (False: it had never
        been ready, the gateway stops)."""
        for worker in list(self.retiring):
            if worker.popen.poll() is not None:
                self.retiring.remove(worker)
                self._mark_dead(worker)
        for index, worker in list(self.workers.items()):
            code = worker.popen.poll()
            if code is None:
                continue
            self._mark_dead(worker)
            if not worker.ready:
                return False
            _log.warning(
                "gateway: worker %d (pid %d) exited with code %s; starting it again",
                index,
                worker.popen.pid,
                code,
            )
            time.sleep(RESTART_DELAY_S)
            replacement = self._spawn(index)
            self.workers[index] = replacement
            if not self._wait_ready(replacement):
                return bool(self._signals.stops)
        return True

    def _reload(self) -> None:
        """SIGHUP: check the configuration, then replace each worker in turn (module docstring)."""
        try:  # with this many workers, as the workers load it (their command line says --workers)
            settings = self._worker_source().load()
        except (ValueError, OSError) as exc:
            _log.error(
                "gateway: reload refused, the configuration does not load (%s); workers unchanged", exc
            )
            return
        kept = ("host", "port")
        changed = [name for name in kept if getattr(settings, name) != getattr(self.settings, name)]
        if not changed:
            self.settings = settings  # (the drain deadline follows timeouts.total_s)
        else:
            _log.warning(
                "gateway: %s changed: applied at the next restart, not by a reload", ", ".join(changed)
            )
        _log.info("gateway: reloading %d workers", self.count)
        for index in range(self.count):
            old = self.workers[index]
            new = self._spawn(index)
            if not self._wait_ready(new):
                if not self._signals.stops:
                    _log.error("gateway: the new worker %d did not start; the old one keeps serving", index)
                _terminate(new.popen)
                self._mark_dead(new)
                return
            self.workers[index] = new
            self.retiring.append(old)
            with contextlib.suppress(ProcessLookupError):
                old.popen.send_signal(signal.SIGTERM)  # it drains its requests in flight, then exits

    def _worker_source(self) -> SettingsSource:
        """Where the workers' settings come from: the gateway's, with ``workers`` fixed to :attr:`count` (a
        config file changed to ``workers: 1`` must not let a reloaded worker accept in-memory limits)."""
        overrides = {**self.source.overrides, "workers": self.count}
        return SettingsSource(self.source.config_path, overrides, self.source.env)

    def _signal_all(self, sig: int) -> None:
        for worker in [*self.workers.values(), *self.retiring]:
            if worker.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.popen.send_signal(sig)

    def _stop_all(self) -> None:
        """SIGTERM to every worker, then wait for them to drain: at most ``timeouts.total_s`` (no request
        lasts longer) + 30 s, then SIGKILL."""
        self._signal_all(signal.SIGTERM)
        for sock in self.sockets:  # the workers' copies close as they stop accepting
            sock.close()
        deadline = time.monotonic() + self.settings.timeouts.total_s + 30
        for worker in [*self.workers.values(), *self.retiring]:
            try:
                worker.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.popen.kill()
                worker.popen.wait()
            self._mark_dead(worker)
            if worker.ready_fd >= 0:
                os.close(worker.ready_fd)
                worker.ready_fd = -1

    def _mark_dead(self, worker: _Worker) -> None:
        """prometheus_client's bookkeeping for an exited worker: its ``live*`` gauges leave the merged view
        (its counters stay: they are totals)."""
        if self.metrics_dir is not None:
            from prometheus_client.multiprocess import mark_process_dead

            mark_process_dead(worker.popen.pid, str(self.metrics_dir))


def _terminate(popen: subprocess.Popen) -> None:
    if popen.poll() is None:
        popen.terminate()
        try:
            popen.wait(10)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


def _worker_preexec() -> None:
    """Worker-side, before exec: SIGTERM when the supervisor dies (prctl PR_SET_PDEATHSIG; it then drains
    and exits), and a process group of its own, so that Ctrl-C in a terminal reaches only the supervisor,
    which stops the workers gracefully (a SIGINT to each as well would be uvicorn's second, forcing one)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass
    os.setpgrp()


def serve_socket(
    app: Any, settings: GatewaySettings, log_level: str, sock: socket.socket, ready_fd: int
) -> None:
    """Worker side: serve ``app`` on the inherited listening socket ``sock`` with the gateway's uvicorn
    settings (gateway/server.py ``uvicorn_config``) and write :data:`READY` to ``ready_fd`` once the app's
    lifespan has started."""
    import uvicorn

    from kvscope.gateway.server import uvicorn_config

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                os.write(ready_fd, READY)
                os.close(ready_fd)

    config = uvicorn_config(app, settings.host, sock.getsockname()[1], log_level)
    _Server(config).run(sockets=[sock])
