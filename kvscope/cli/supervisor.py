"""``kvscope serve``: the one-command stack on a laptop — engine + gateway as child processes.

Pulls the default model if missing, checks the gateway's options as the gateway would (a bad
``--gateway-args`` value is refused before any engine starts), starts the engine on a private loopback port
(``--replicas N``: N engines on ports of their own, the CPUs split between them), waits until it is healthy,
starts the gateway in front of it (one ``--upstream`` per engine), waits until it is ready, prints the URL,
the console's (gateway/console/) and a copy-paste request, then forwards Ctrl-C/SIGTERM to all. Children get
PR_SET_PDEATHSIG so that even a SIGKILLed supervisor leaves no orphan process behind (Linux).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvscope.common.cli_help import HelpFormatter
from kvscope.common.models.cache import hf_dir
from kvscope.common.models.registry import default_served_name, is_registered
from kvscope.common.models.settings import ModelSettings
from kvscope.common.net import SERVE_PORT

READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 15.0
ENGINE_KEY_ENV = "KVSCOPE_ENGINE_API_KEY"


@dataclass(frozen=True, slots=True)
class ServeOptions:
    model: str
    host: str
    port: int
    engine_port: int
    log_file: Path
    engine_args: tuple[str, ...]
    gateway_args: tuple[str, ...]
    replicas: int = 1
    """Engines to start; the first listens on ``engine_port``, the others on free ports."""
    gateway_workers: int = 1
    """Gateway processes on ``port`` (``kvscope gateway --workers``, gateway/workers.py)."""


def _replica_count(text: str, what: str = "engines to start") -> int:
    """``--replicas``: an integer >= 1 (argparse answers anything else as a usage error, status 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 ({what}), got {value}")
    return value


def _worker_count(text: str) -> int:
    """``--gateway-workers``: an integer >= 1."""
    return _replica_count(text, "gateway processes")


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container's cpuset, taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def engine_threads(replicas: int, cpus: int) -> int | None:
    """torch threads per engine when ``replicas`` engines share ``cpus`` CPUs: max(1, cpus // replicas);
    None for one engine (its own default, kvscope.common.engine_defaults: all CPUs but one)."""
    return None if replicas == 1 else max(1, cpus // replicas)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvscope serve", description=(__doc__ or "").partition("\n")[0], formatter_class=HelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m", help="registry name, HF folder or .gguf file")
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address (auth is off only on loopback)")
    p.add_argument("--port", type=int, default=SERVE_PORT, help="gateway port")
    p.add_argument(
        "--engine-port", type=int, default=0, help="(first) engine port on 127.0.0.1 (0 = a free port)"
    )
    p.add_argument(
        "--replicas",
        type=_replica_count,
        default=1,
        metavar="N",
        help="engines to start on this machine (free ports after the first, each with usable CPUs // N "
        "threads); the gateway balances over them",
    )
    p.add_argument(
        "--gateway-workers",
        type=_worker_count,
        default=1,
        metavar="N",
        help="gateway processes on the port (kvscope gateway --workers; the console is off above 1)",
    )
    p.add_argument("--log-file", type=Path, help="request log (default: <cache>/logs/requests.jsonl)")
    p.add_argument(
        "--engine-args", default="", help="extra `kvscope engine` options, e.g. '--max-model-len 4096'"
    )
    p.add_argument("--gateway-args", default="", help="extra `kvscope gateway` options")
    return p


def serve_main(argv: list[str]) -> int:
    """Run engine + gateway until Ctrl-C/SIGTERM. Returns 0 on a requested stop, 1 if a child failed."""
    args = _parser().parse_args(argv)
    settings = ModelSettings.from_env()
    options = ServeOptions(
        model=args.model,
        host=args.host,
        port=args.port,
        engine_port=args.engine_port or _free_port(),
        log_file=args.log_file or settings.cache_root / "logs" / "requests.jsonl",
        engine_args=tuple(shlex.split(args.engine_args)),
        gateway_args=tuple(shlex.split(args.gateway_args)),
        replicas=args.replicas,
        gateway_workers=args.gateway_workers,
    )
    if is_registered(options.model):
        from kvscope.common.models.pull import pull

        pull(options.model)
    return Supervisor(options).run()


class Supervisor:
    """Owns the child processes (the engines, then the gateway) and their shutdown."""

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.children: list[subprocess.Popen] = []
        self.names: dict[int, str] = {}
        """Child pid → what it is ("engine 2 (port 41234)", "gateway") for the message when one exits."""
        self._stop_requested = False
        self.engine_ports = [options.engine_port]
        """The engines' ports: ``engine_port``, then free ones."""
        while len(self.engine_ports) < options.replicas:
            port = _free_port()
            if port not in self.engine_ports and port != options.port:
                self.engine_ports.append(port)

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            self._check_engine_key()
            self._check_ports_free()
            self._check_gateway_options()
            self._start_engines()
            self._start_gateway()
            self._print_banner()
            return self._wait()
        except _ChildFailed as exc:
            print(f"kvscope serve: {exc}", file=sys.stderr)
            return 1
        except _StopRequested:
            return 0
        finally:
            self._stop_children()

    def _on_signal(self, signum: int, _frame) -> None:
        self._stop_requested = True

    def _check_engine_key(self) -> None:
        """The engine's ``--api-key`` (or ``$KVSCOPE_ENGINE_API_KEY``) would lock out the gateway started
        here, which calls it without a key: every health check would get 401 and serve would wait for a
        readiness that never comes. The engine listens on a private loopback port here, so say so at once."""
        if (
            "--api-key" in self.options.engine_args
            or any(a.startswith("--api-key=") for a in self.options.engine_args)
            or os.environ.get(ENGINE_KEY_ENV)
        ):
            raise _ChildFailed(
                f"an engine API key (--api-key or ${ENGINE_KEY_ENV}) is not supported by kvscope "
                "serve, whose engine listens only on a private loopback port behind the gateway; "
                f"unset it, or run `kvscope engine --api-key …` and `kvscope gateway` with the "
                "upstream's api_key in the gateway config (docs/engine-server.md)"
            )

    def _check_ports_free(self) -> None:
        """Fail before loading anything when a port is taken: otherwise another server on the gateway's
        port would answer the readiness probe and the banner would point at it (uvicorn's bind error comes
        later)."""
        o = self.options
        engines = [("127.0.0.1", port, "--engine-port") for port in self.engine_ports]
        for host, port, flag in ((o.host, o.port, "--port"), *engines):
            problem = _bind_problem(host, port)
            if problem is not None:
                raise _ChildFailed(
                    f"cannot listen on {host}:{port} ({problem}); is another kvscope serve running? "
                    + _port_advice(flag, port)
                )

    def engine_command(self, index: int, pinned: tuple[str, ...] = ()) -> list[str]:
        """The command of engine ``index`` (0-based): on its own port, with usable CPUs // replicas threads
        when there are several (unless ``--engine-args`` sets ``--num-threads``); ``pinned``: more flags (the
        first replica's weight format for the others)."""
        o = self.options
        # -P: no working folder on sys.path, so a `kvscope serve` run from the repository root imports Hugging
        # Face's top-level `kernels` (which transformers loads), not the repository's kernels/ folder.
        cmd = [
            sys.executable,
            "-P",
            "-m",
            "kvscope.cli",
            "engine",
            "--model",
            o.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.engine_ports[index]),
        ]
        threads = engine_threads(o.replicas, usable_cpus())
        given = any(a == "--num-threads" or a.startswith("--num-threads=") for a in o.engine_args)
        if threads is not None and not given:
            cmd += ["--num-threads", str(threads)]
        return [*cmd, *pinned, *o.engine_args]

    def _engine_name(self, index: int) -> str:
        if self.options.replicas == 1:
            return "engine"
        return f"engine {index + 1} (port {self.engine_ports[index]})"

    def _start_engines(self) -> None:
        """Start the first engine and wait until it is healthy; then the others, side by side, with the weight
        format the first one's start-up probe chose (``--dtype``/``--quantization`` from its card), so that
        every replica serves the same numbers whatever the load during their probes; then wait for them."""
        first = self._start_engine(0)
        card = self._ready(first, 0)
        pinned = () if self._format_given() else _format_flags(card)
        rest = [self._start_engine(index, pinned) for index in range(1, self.options.replicas)]
        for index, child in enumerate(rest, start=1):
            self._ready(child, index)

    def _start_engine(self, index: int, pinned: tuple[str, ...] = ()) -> subprocess.Popen:
        cmd, log_path = self.engine_command(index, pinned), self.engine_logs[index]
        print(f"starting engine: {shlex.join(cmd[3:])}  (its JSON request log: {log_path})", flush=True)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:  # the child keeps its own descriptor
            child = self._spawn(cmd, stdout=log)
        self.names[child.pid] = self._engine_name(index)
        return child

    def _ready(self, child: subprocess.Popen, index: int) -> dict[str, Any] | None:
        """Wait until engine ``index`` is healthy, print its weight format; returns its model card."""
        port, name = self.engine_ports[index], self._engine_name(index)
        self._wait_ready(child, f"http://127.0.0.1:{port}/health", name)
        card = _model_card(f"http://127.0.0.1:{port}/v1/models")
        line = engine_format_line(card)
        print(line if self.options.replicas == 1 else f"{name}: {line}", flush=True)
        return card

    def _format_given(self) -> bool:
        flags = ("--dtype", "--quantization")
        return any(
            a in flags or a.startswith(tuple(f + "=" for f in flags)) for a in self.options.engine_args
        )

    @property
    def engine_log(self) -> Path:
        """Where the engine's stdout (one JSON line per request, engine/server/access_log.py) goes: beside the
        gateway's request log, so the terminal shows the banner and warnings, not a line per request."""
        return self.options.log_file.with_name(
            "engine.ndjson"
        )  # not *.jsonl: `kvscope logs` on the folder reads gateway records only

    @property
    def engine_logs(self) -> list[Path]:
        """Each engine's log: :attr:`engine_log` for one engine, ``engine-1.ndjson`` … for several."""
        if self.options.replicas == 1:
            return [self.engine_log]
        return [self.engine_log.with_name(f"engine-{i + 1}.ndjson") for i in range(self.options.replicas)]

    @property
    def engine_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.engine_ports]

    def _check_gateway_options(self) -> None:
        """Refuse what the gateway would refuse (``--gateway-args``, a config file they name) before any
        engine starts. Raises _ChildFailed with the gateway's message."""
        from kvscope.gateway.cli import check_gateway_args

        problem = check_gateway_args(self.gateway_options())
        if problem is not None:
            raise _ChildFailed(f"gateway: {problem}")

    def gateway_options(self) -> list[str]:
        """The gateway's options (``kvscope gateway …``): one ``--upstream`` per engine, the request log, the
        tokenizer for cache-aware routing, then ``--gateway-args``."""
        o = self.options
        options = [
            "--host",
            o.host,
            "--port",
            str(o.port),
            *(arg for url in self.engine_urls for arg in ("--upstream", url)),
            "--log-file",
            str(o.log_file),
        ]
        if o.gateway_workers > 1:
            options += ["--workers", str(o.gateway_workers)]
        tokenizer = _tokenizer_path(o.model)
        if tokenizer is not None:
            served = _served_name(o)
            options += ["--tokenizer", f"{served}={tokenizer}"]
        options += list(o.gateway_args)
        return options

    def _start_gateway(self) -> None:
        self.options.log_file.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-P", "-m", "kvscope.cli", "gateway", *self.gateway_options()]
        print(f"starting gateway: {shlex.join(cmd[3:])}", flush=True)
        child = self._spawn(cmd)
        self.names[child.pid] = "gateway"
        o = self.options
        self._wait_ready(child, f"http://{_client_host(o.host)}:{o.port}/readyz", "gateway")

    def _spawn(self, cmd: list[str], stdout: Any = None) -> subprocess.Popen:
        child = subprocess.Popen(cmd, stdout=stdout, preexec_fn=_die_with_parent)  # noqa: PLW1509 - pdeathsig
        self.children.append(child)
        return child

    def _wait_ready(self, child: subprocess.Popen, url: str, name: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            self._check_stop()
            if child.poll() is not None:
                raise _ChildFailed(f"{name} exited with code {child.returncode} before it was ready")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise _ChildFailed(f"{name} not ready after {READY_TIMEOUT_S:.0f} s ({url})")

    def _print_banner(self) -> None:
        o = self.options
        base = f"http://{_client_host(o.host)}:{o.port}"
        console = (
            ""
            if "--no-console" in o.gateway_args or o.gateway_workers > 1
            else f"\nconsole (live charts, the newest requests, alert conditions): {base}/console\n"
        )
        replicas = (
            ""
            if o.replicas == 1
            else f"{o.replicas} engine replicas behind the gateway:\n"
            + "".join(
                f"  {url}  (log {log})\n" for url, log in zip(self.engine_urls, self.engine_logs, strict=True)
            )
        )
        print(
            f"""
kvscope is serving {_served_name(o)} at {base}/v1  (metrics: {base}/metrics, request log: {o.log_file})
{replicas}
  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{_served_name(o)}", "max_tokens": 32,
         "messages": [{{"role": "user", "content": "Hello!"}}]}}'
{console}
Press Ctrl-C to stop.
""",
            flush=True,
        )

    def _wait(self) -> int:
        while True:
            self._check_stop()
            for child in self.children:
                if child.poll() is not None:
                    name = self.names.get(child.pid, "child")
                    raise _ChildFailed(f"{name} exited with code {child.returncode}")
            time.sleep(0.2)

    def _check_stop(self) -> None:
        if self._stop_requested:
            raise _StopRequested

    def _stop_children(self) -> None:
        for child in reversed(self.children):  # gateway first, then the engine
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in reversed(self.children):
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


class _ChildFailed(RuntimeError):
    pass


class _StopRequested(Exception):
    pass


def _model_card(url: str) -> dict[str, Any] | None:
    """The first card of the engine's /v1/models, None when it cannot be read."""
    try:
        return httpx.get(url, timeout=5.0).json()["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


def engine_format_line(card: dict[str, Any] | None) -> str:
    """The line ``kvscope serve`` prints once the engine is up: the weight format it serves (the ``kvscope``
    field of its /v1/models card, engine/server/protocol.py ``ModelFormatInfo``), sizes in MiB, and how to
    get exact float32 unless it already serves that (dtype float32, no quantization); the hint says
    "dense float32 weights", since an engine serving dtype float32 with gguf weights is told it too. Why the
    engine chose the format is said once, in its own ``weights format`` log line just above (the card's
    ``reason``)."""
    fmt = (card or {}).get("kvscope")
    if not fmt:
        return "engine weight format: unknown (its /v1/models card has no kvscope field)"
    kernels = f", CPU kernels {fmt['cpu_kernels']}" if fmt.get("cpu_kernels") else ""
    exact = (fmt["dtype"], fmt["quantization"]) == ("float32", "none")
    hint = "" if exact else "; dense float32 weights, exact as transformers: --engine-args '--dtype float32'"
    return (
        f"engine weight format: dtype {fmt['dtype']}, quantization {fmt['quantization']}, weights "
        f"{fmt['weights_bytes'] / (1 << 20):.0f} MiB, process RSS {fmt['rss_bytes'] / (1 << 20):.0f} MiB"
        f"{kernels}{hint}"
    )


def _port_advice(flag: str, port: int) -> str:
    """How to move off a taken ``port`` for the flag that set it, for both entry points: ``kvscope serve``
    takes ``--port``; ``make run`` takes no flags, its ``PORT`` variable is passed as ``--port`` (Makefile).
    The engine's port is free by default (``--engine-port 0``): only an explicit one can be taken."""
    if flag == "--port":
        return (
            f"Stop it, or serve on another port, e.g. `kvscope serve --port {port + 1}` "
            f"(with make: `make run PORT={port + 1}`)"
        )
    return f"Stop it, or pass {flag} with a free port (or leave it out: kvscope serve picks a free one)"


def _die_with_parent() -> None:
    """Child-side: receive SIGTERM when the supervisor dies (prctl PR_SET_PDEATHSIG = 1)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass
    os.setpgrp()  # Ctrl-C in the terminal reaches only the supervisor, which stops children in order


def _bind_problem(host: str, port: int) -> str | None:
    """None when ``host:port`` can be bound now, else the OS's reason (e.g. "Address already in use")."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as uvicorn does: TIME_WAIT is not "taken"
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _served_name(options: ServeOptions) -> str:
    args = list(options.engine_args)
    if "--served-model-name" in args:
        return args[args.index("--served-model-name") + 1]
    return default_served_name(
        options.model
    )  # the engine's own default (a path is served by its file's name)


def _tokenizer_path(model: str) -> Path | None:
    """tokenizer.json of the served model, for exact prompt-length checks at the edge (None if unknown)."""
    candidates = (
        [hf_dir(model) / "tokenizer.json"] if is_registered(model) else [Path(model) / "tokenizer.json"]
    )
    return next((c for c in candidates if c.is_file()), None)


def _format_flags(card: dict[str, Any] | None) -> tuple[str, ...]:
    """``--dtype X --quantization Y`` as a model card's ``kvscope`` field reports them (empty without)."""
    info = (card or {}).get("kvscope") or {}
    dtype, quantization = info.get("dtype"), info.get("quantization")
    if not isinstance(dtype, str) or not isinstance(quantization, str):
        return ()
    return ("--dtype", dtype, "--quantization", quantization)
