"""The console's HTTP side: its pages and static files, its JSON API under ``/console/api``, its state
(:class:`Console`, one per app, ``app.state.console``) and its lifespan (the sampler's task).

Pages (``/console``, ``/console/requests``, ``/console/requests/{id}``, ``/console/health``) are one HTML
file; the browser code (static/console.js, plain JavaScript, no build step) draws them from the API, with the
vendored uPlot (static/vendor/) for the charts, everything from this package: the console works offline.

API (JSON; access: gateway/console/access.py; errors OpenAI-shaped like every gateway error):

- ``GET /console/api/session`` who is looking (401 when a login is needed); ``POST`` ``{"key": …}`` logs in
  (sets the session cookie), ``DELETE`` logs out;
- ``GET /console/api/overview?since=T`` the chart points after epoch second ``T`` (all kept without it), the
  totals since start and the replicas (gateway/console/series.py ``ConsoleSeries.columns``);
- ``GET /console/api/requests?model=&key=&status=&finish_reason=&slower_than=&limit=`` the newest records'
  rows, newest first (gateway/console/records.py);
- ``GET /console/api/requests/{event_id}`` one record: the log line itself, its waterfall, the ``kvscope logs
  why`` explanation (gateway/logs/why.py) and its trace link;
- ``GET /console/api/health`` the shipped alert conditions now (gateway/console/alerts.py) and the replicas.

Console requests are not observed (no log record, metrics or span: gateway/app.py lets them through like the
probes), so an open console never shows up in the request list or the request counters it draws.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib.resources.abc import Traversable
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, delete, get, post
from litestar.datastructures import Cookie

from kvscope.gateway.console.access import COOKIE, SESSION_TTL_S, ConsoleAccess
from kvscope.gateway.console.alerts import AlertBoard, histogram_window_s, load_rules
from kvscope.gateway.console.records import RecordFilter, RecordRing, facets, summary, waterfall
from kvscope.gateway.console.sampler import ConsoleSampler
from kvscope.gateway.console.series import CHART_WINDOW_S, ConsoleSeries
from kvscope.gateway.errors import InvalidJson, InvalidRequest, NotFound
from kvscope.gateway.logs.why import explain
from kvscope.gateway.state import GatewayState

PREFIX = "/console"
OVERVIEW_BODIES = 8
"""Encoded overview answers kept per tick (by ``since``: an open page asks with the newest point it has, so
every page open since the last tick shares one or two)."""
REQUESTS_BODIES = 16
"""Encoded request-list answers kept until the next record (by filters and limit: every open requests page
polls every 2 s, and pages with the same filters share one answer instead of each rebuilding up to
:data:`MAX_ROWS` rows on the event loop)."""
PAGES = ("/console", "/console/requests", "/console/health")
MAX_ROWS = 1000
STATIC_TYPES = {
    # Litestar appends "; charset=utf-8" to text/* media types itself
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
    "": "text/plain",  # LICENSE, README.md
}
PAGE_HEADERS = {
    # only this package's files: no inline script or style, no other origin (the vendored uPlot sets
    # element styles from script, which style-src does not govern)
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
API_HEADERS = {"cache-control": "no-store", "x-content-type-options": "nosniff"}


def is_console_path(path: str) -> bool:
    """Whether ``path`` is the console's (``/console`` or below)."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def _static_files(root: Traversable, prefix: str = "") -> dict[str, bytes]:
    """Every file under ``root`` (the package's static/ folder), by its path relative to it."""
    files: dict[str, bytes] = {}
    for entry in root.iterdir():
        name = prefix + entry.name
        if entry.is_dir():
            files.update(_static_files(entry, name + "/"))
        elif entry.is_file():
            files[name] = entry.read_bytes()
    return files


@dataclass
class Console:
    """The console's parts, one per app (``app.state.console``): built by :func:`build_console`."""

    gateway: GatewayState
    records: RecordRing
    series: ConsoleSeries
    board: AlertBoard
    sampler: ConsoleSampler
    access: ConsoleAccess
    static: dict[str, bytes]
    overview_bodies: dict[float | None, bytes] = field(default_factory=dict)
    """The encoded ``/console/api/overview`` answers of the latest tick, by ``since`` (at most
    :data:`OVERVIEW_BODIES`): everything in them changes only when a tick is added, so the polls between two
    ticks (an open page asks once a second, the sampler ticks every 2 s) get the same bytes."""
    overview_tick: int = -1
    """``series.added`` when ``overview_bodies`` was filled."""
    requests_bodies: dict[tuple[Any, ...], bytes] = field(default_factory=dict)
    """The encoded ``/console/api/requests`` answers since the last record, by filters and limit (at most
    :data:`REQUESTS_BODIES`)."""
    requests_version: int = -1
    """``records.appended`` when ``requests_bodies`` was filled."""

    def requests_body(self, wanted: RecordFilter, limit: int) -> bytes:
        """The request list's answer: the newest kept records' rows that pass ``wanted``, newest first, at
        most ``limit``; encoded once per filter until a record is added."""
        if self.requests_version != self.records.appended:
            self.requests_bodies.clear()
            self.requests_version = self.records.appended
        key = (wanted, limit)
        body = self.requests_bodies.get(key)
        if body is None:
            kept = list(self.records.records)
            rows = [summary(r) for r in reversed(kept) if wanted.matches(r)][:limit]
            answer = {
                "rows": rows,
                "kept": len(kept),
                "capacity": self.records.capacity,
                "facets": facets(kept),
            }
            body = msgspec.json.encode(answer)
            if len(self.requests_bodies) < REQUESTS_BODIES:
                self.requests_bodies[key] = body
        return body

    def overview_body(self, since: float | None) -> bytes:
        """The overview answer (JSON) for the points after ``since`` (epoch seconds; None: all kept)."""
        if self.overview_tick != self.series.added:
            self.overview_bodies.clear()
            self.overview_tick = self.series.added
        body = self.overview_bodies.get(since)
        if body is None:
            body = msgspec.json.encode(_overview(self, since))
            if len(self.overview_bodies) < OVERVIEW_BODIES:
                self.overview_bodies[since] = body
        return body


def build_console(gw: GatewayState) -> Console:
    """The console of ``gw``: its record ring joins ``gw.sinks`` (it sees every record the log writer
    emits); the alert rules are read from the shipped rules file (raises ValueError if it does not parse)."""
    rules, routes = load_rules()
    series = ConsoleSeries(histogram_window_s=histogram_window_s(rules, CHART_WINDOW_S))
    records = RecordRing(gw.settings.console.records)
    gw.sinks.append(records)
    board = AlertBoard(rules)
    sampler = ConsoleSampler(gw.metrics.registry, lambda: gw.pool.replicas, records, series, board, routes)
    static = _static_files(importlib.resources.files("kvscope.gateway.console") / "static")
    return Console(
        gw, records, series, board, sampler, ConsoleAccess(gw.auth, gw.settings.auth_enabled), static
    )


@contextlib.asynccontextmanager
async def console_lifespan(app: Litestar) -> AsyncIterator[None]:
    """Take the first tick (the counters before any request) and run the sampler until shutdown."""
    console: Console | None = app.state.get("console")
    if console is None:
        yield
        return
    console.sampler.tick()
    task = asyncio.create_task(console.sampler.run(), name="kvscope-console-sampler")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def console_of(request: Request) -> Console:
    return request.app.state.console


def _json(content: Any, status_code: int = 200) -> Response:
    return Response(content, status_code=status_code, headers=API_HEADERS, media_type="application/json")


# --- pages and files ---------------------------------------------------------------------------------------
def _page(request: Request) -> Response:
    return Response(
        console_of(request).static["index.html"], headers=PAGE_HEADERS, media_type=STATIC_TYPES[".html"]
    )


@get(list(PAGES), sync_to_thread=False, include_in_schema=False)
def page(request: Request) -> Response:
    """The console's pages: one HTML file; the script draws the page its path names."""
    return _page(request)


@get("/console/requests/{event_id:str}", sync_to_thread=False, include_in_schema=False)
def request_page(request: Request) -> Response:
    return _page(request)


@get("/console/static/{name:path}", sync_to_thread=False, include_in_schema=False)
def static_file(request: Request) -> Response:
    """A file of the package's static/ folder (a fixed set read at start: no path reaches the disk)."""
    name = str(request.path_params["name"]).lstrip("/")
    body = console_of(request).static.get(name)
    if body is None or name == "index.html":
        raise NotFound(f"No console file {name!r}.")
    suffix = name[name.rfind(".") :] if "." in name.rsplit("/", 1)[-1] else ""
    return Response(body, headers=PAGE_HEADERS, media_type=STATIC_TYPES.get(suffix, STATIC_TYPES[""]))


# --- session ------------------------------------------------------------------------------------------------
@get("/console/api/session", sync_to_thread=False, include_in_schema=False)
def session(request: Request) -> Response:
    """``{"auth": whether keys are configured, "viewer": the key's name}``; 401/403 as every API call."""
    console = console_of(request)
    viewer = console.access.viewer(request)
    return _json(
        {"auth": console.access.auth_enabled, "viewer": viewer.name, "log_content": _content(console)}
    )


@post("/console/api/session", status_code=200, include_in_schema=False)
async def login(request: Request) -> Response:
    """Log in with ``{"key": "sk-kvs-…"}`` (JSON): sets the session cookie; 401 for an unknown key, 403 for
    a key that is not an admin key, 400 for another body."""
    console = console_of(request)
    try:
        body = msgspec.json.decode(await request.body())
    except msgspec.DecodeError as exc:
        raise InvalidJson(f"The body is not JSON: {exc}") from None
    key = body.get("key") if isinstance(body, dict) else None
    if not isinstance(key, str) or not key.strip():
        raise InvalidRequest('Expected {"key": "<admin API key>"}.', param="key")
    if not console.access.auth_enabled:
        return _json({"auth": False, "viewer": "anonymous", "log_content": _content(console)})
    token, viewer = console.access.login(key.strip())
    response = _json({"auth": True, "viewer": viewer.name, "log_content": _content(console)})
    response.set_cookie(_cookie(request, token, int(SESSION_TTL_S)))
    return response


@delete("/console/api/session", status_code=200, include_in_schema=False, sync_to_thread=False)
def logout(request: Request) -> Response:
    """End the session and clear its cookie."""
    console_of(request).access.logout(request)
    response = _json({"auth": console_of(request).access.auth_enabled})
    response.set_cookie(_cookie(request, "", 0))
    return response


def _cookie(request: Request, value: str, max_age: int) -> Cookie:
    return Cookie(
        key=COOKIE,
        value=value,
        path=PREFIX,
        max_age=max_age,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def _content(console: Console) -> bool:
    return console.gateway.settings.logs.log_content


# --- data ---------------------------------------------------------------------------------------------------
def _float_param(request: Request, name: str) -> float | None:
    text = request.query_params.get(name)
    if text in (None, ""):
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # nan/inf would reach int() (a 500) or compare as nothing
        raise InvalidRequest(f"{name} must be a finite number, got {text[:64]!r}.", param=name)
    return value


@get("/console/api/overview", sync_to_thread=False, include_in_schema=False)
def overview(request: Request) -> Response:
    """The chart points after ``since`` (epoch seconds; all kept without it), the totals and the replicas."""
    console = console_of(request)
    console.access.viewer(request)
    return _json(console.overview_body(_float_param(request, "since")))


def _overview(console: Console, since: float | None) -> dict[str, Any]:
    series = console.series
    latest = series.latest
    return {
        "interval_s": series.interval_s,
        "history_s": series.history_s,
        "window_s": series.chart_window_s,
        **series.columns(since),
        "totals": _totals(latest.counters) if latest else None,
        "replicas": [r.to_dict() for r in latest.replicas] if latest else [],
        "alerts": _alert_counts(console),
    }


def _totals(c: Any) -> dict[str, Any]:
    """Cumulative counts since the gateway started (the same sums ``/metrics`` gives)."""
    return {
        "requests": c.requests,
        "by_status": dict(c.by_status),
        "errors": sum(v for s, v in c.by_status.items() if s.isdigit() and int(s) >= 400)
        + sum(c.stream_errors.values()),
        "stream_errors": dict(c.stream_errors),
        "rate_limited": dict(c.rate_limited),
        "input_tokens": c.input_tokens,
        "output_tokens": c.output_tokens,
        "cached_tokens": c.cached_tokens,
        "in_flight": c.in_flight,
    }


def _alert_counts(console: Console) -> dict[str, int]:
    counts = {"firing": 0, "pending": 0}
    for status in console.board.statuses:
        if status.state in counts:
            counts[status.state] += 1
    return counts


@get("/console/api/requests", sync_to_thread=False, include_in_schema=False)
def requests(request: Request) -> Response:
    """The newest records' rows that pass the filters, newest first (at most ``limit``, default and most
    :data:`MAX_ROWS`: every kept record)."""
    console = console_of(request)
    console.access.viewer(request)
    q = request.query_params
    try:
        wanted = RecordFilter(
            model=q.get("model") or None,
            key=q.get("key") or None,
            status=q.get("status") or None,
            finish_reason=q.get("finish_reason") or None,
            slower_than_s=_float_param(request, "slower_than"),
        )
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    limit = _float_param(request, "limit")
    limit_n = MAX_ROWS if limit is None else int(limit)
    if not 1 <= limit_n <= MAX_ROWS:
        raise InvalidRequest(f"limit must be 1 to {MAX_ROWS}.", param="limit")
    return _json(console.requests_body(wanted, limit_n))


@get("/console/api/requests/{event_id:str}", sync_to_thread=False, include_in_schema=False)
def request_detail(request: Request) -> Response:
    """One kept record (by ``event.id``): the line, its row, waterfall, explanation and trace link."""
    event_id = str(request.path_params["event_id"])
    console = console_of(request)
    console.access.viewer(request)
    record = console.records.find(event_id)
    if record is None:
        raise NotFound(
            f"No request {event_id[:64]!r} among the newest {console.records.capacity} (the console keeps "
            "only those; `kvscope logs why` reads the whole log)."
        )
    try:
        why = explain(record)
        explanation: dict[str, Any] = {
            "text": why.text,
            "verdict": why.verdict,
            "causes": [{"cause": c, "seconds": s} for c, s in why.causes],
        }
    except ValueError as exc:
        explanation = {"error": str(exc)}
    trace_id = (record.get("trace") or {}).get("id")
    template = console.gateway.settings.console.trace_url
    return _json(
        {
            "record": record,
            "summary": summary(record),
            "waterfall": waterfall(record),
            "why": explanation,
            "trace": {
                "id": trace_id,
                "url": template.replace("{trace_id}", trace_id) if template and trace_id else None,
            },
        }
    )


@get("/console/api/health", sync_to_thread=False, include_in_schema=False)
def health(request: Request) -> Response:
    """The shipped alert conditions now (rules in file order, one row per subject) and the replicas."""
    console = console_of(request)
    console.access.viewer(request)
    latest = console.series.latest
    return _json(
        {
            "alerts": [s.to_dict() for s in console.board.statuses],
            "replicas": [r.to_dict() for r in latest.replicas] if latest else [],
            "history_s": console.series.span_s(),
            "interval_s": console.series.interval_s,
        }
    )


CONSOLE_ROUTES = [
    page,
    request_page,
    static_file,
    session,
    login,
    logout,
    overview,
    requests,
    request_detail,
    health,
]
