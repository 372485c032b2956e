"""Who may open the console (docs/console.md "Access").

Without API keys the console is open, like the API: the gateway refuses to serve a non-loopback address
without keys unless told to (``allow_unauthenticated``), so by default that is loopback only. With API keys
configured, only keys marked ``admin: true`` see anything but the login form: every ``/console/api/*`` call
needs an admin key, from either

- ``Authorization: Bearer <key>`` (scripts, curl), or
- the session cookie :data:`COOKIE`, which the login form gets by POSTing the key once to
  ``/console/api/session``.

Why a cookie and not a key kept by the page: the key never stays in the browser (no ``sessionStorage`` a
script injected into the page could read; the cookie is ``HttpOnly``), the page's requests need no code to
add a header, and it is never in a URL (no history, logs or ``Referer`` carry it). The cookie holds a random
session id (256 bits), not the key; the gateway keeps only the id's sha256 with the key's principal, for
:data:`SESSION_TTL_S` at most, in memory (a restart logs everyone out). ``SameSite=Strict`` keeps other sites'
pages from sending it (the console's only writes are log in and log out; everything else is a GET that
changes nothing), ``Path=/console`` keeps it off the API, and ``Secure`` is set when the request came over
HTTPS.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field

from litestar.connection import ASGIConnection

from kvscope.gateway.auth import Authenticator, Principal
from kvscope.gateway.errors import AuthenticationFailed, PermissionDenied

COOKIE = "kvscope_console"
SESSION_TTL_S = 12 * 3600.0
MAX_SESSIONS = 1024
"""Sessions kept at most; the oldest goes first."""
NOT_ADMIN = (
    "This API key may not open the console: it needs a key marked `admin: true` in the gateway config "
    "(`kvscope keys create --admin`)."
)


@dataclass(frozen=True, slots=True)
class Viewer:
    """Who is looking: the admin key's name, or ``anonymous`` when no key is configured."""

    name: str
    authenticated: bool


@dataclass
class ConsoleAccess:
    """Checks each console API call; keeps the login sessions."""

    auth: Authenticator
    auth_enabled: bool
    _sessions: dict[str, tuple[Principal, float]] = field(default_factory=dict)
    """sha256(session id) → (the admin principal, monotonic expiry)."""

    def viewer(self, connection: ASGIConnection) -> Viewer:
        """The viewer of a console API call. Raises AuthenticationFailed (401: no or an unknown key, no or an
        expired session) or PermissionDenied (403: a valid key that is not an admin key)."""
        if not self.auth_enabled:
            return Viewer("anonymous", authenticated=False)
        authorization = connection.headers.get("authorization")
        if authorization:
            return self._admin(self.auth.authenticate(authorization))
        token = connection.cookies.get(COOKIE)
        if token:
            entry = self._sessions.get(_digest(token))
            if entry is not None and entry[1] > time.monotonic():
                return Viewer(entry[0].key_id, authenticated=True)
        raise AuthenticationFailed(
            "Log in to the console with an admin API key.", code="console_login_required"
        )

    def login(self, key: str) -> tuple[str, Viewer]:
        """A new session for an admin ``key``: (the session id to set as the cookie, the viewer). Raises as
        :meth:`viewer`."""
        principal = self.auth.authenticate(f"Bearer {key}")
        viewer = self._admin(principal)
        now = time.monotonic()
        self._sessions = {k: v for k, v in self._sessions.items() if v[1] > now}
        while len(self._sessions) >= MAX_SESSIONS:
            self._sessions.pop(next(iter(self._sessions)))
        token = secrets.token_urlsafe(32)
        self._sessions[_digest(token)] = (principal, now + SESSION_TTL_S)
        return token, viewer

    def logout(self, connection: ASGIConnection) -> None:
        """End the session of the request's cookie (if any)."""
        token = connection.cookies.get(COOKIE)
        if token:
            self._sessions.pop(_digest(token), None)

    @staticmethod
    def _admin(principal: Principal) -> Viewer:
        if not principal.admin:
            raise PermissionDenied(NOT_ADMIN, code="console_admin_required")
        return Viewer(principal.key_id, authenticated=True)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()
