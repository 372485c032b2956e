"""Bearer API keys, stored only as sha256 hex digests, compared in constant time.

A key is ``sk-kvs-`` + 43 url-safe characters (256 random bits from :mod:`secrets`). The config holds
``sha256(key)``; a presented key is hashed and compared against every configured digest with
:func:`hmac.compare_digest`, visiting all of them, so the time taken does not depend on which (if any)
matched.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from kvscope.gateway.errors import AuthenticationFailed, PermissionDenied
from kvscope.gateway.settings import ApiKeyConfig, KeyLimits

KEY_PREFIX = "sk-kvs-"
ANONYMOUS = "anonymous"
TENANT_HEADER = "x-kvscope-tenant"
"""Set on the upstream request of a keyed caller to its key's name (``user.id``; never the key itself): the
engine scheduler's tenant, whose share its requests split (docs/engine-server.md). Without keys it is not
sent, and a client's own header of that name is never forwarded."""
SERVICE_TIER_HEADER = "x-kvscope-service-tier"
"""Set on the upstream request of a key with a ``service_tier``: the engine's tier of its requests, their
default and the best they get (engine/server/scheduling.py). A client's own header is never forwarded."""


def generate_key() -> str:
    """A new random API key (shown to the user once; only its hash is stored)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """sha256 hex digest of the key text."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a configured key, or the anonymous client when auth is off."""

    key_id: str
    """The key's name (``user.id`` in logs), ``anonymous`` without auth."""
    models: frozenset[str] | None
    """Allowed models; ``None``: all."""
    limits: KeyLimits
    authenticated: bool
    admin: bool = False
    """A key marked ``admin`` in the config: it may open the console (gateway/console/access.py)."""
    service_tier: str | None = None
    """The key's engine tier (ApiKeyConfig.service_tier), sent as ``x-kvscope-service-tier``; None: none."""


class Authenticator:
    """Checks ``Authorization: Bearer <key>`` against the configured digests."""

    def __init__(self, keys: tuple[ApiKeyConfig, ...], default_limits: KeyLimits) -> None:
        self._keys = [(bytes.fromhex(k.sha256), k) for k in keys]
        self._anonymous = Principal(ANONYMOUS, None, default_limits, authenticated=False)
        self._principals = {
            k.name: Principal(
                k.name,
                frozenset(k.models) if k.models is not None else None,
                k.limits.merged(default_limits),
                authenticated=True,
                admin=k.admin,
                service_tier=k.service_tier,
            )
            for k in keys
        }

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal for an ``Authorization`` header value.

        Raises AuthenticationFailed (401) when auth is on and the header is missing, not ``Bearer``, or the
        key matches no digest.
        """
        if not self._keys:
            return self._anonymous
        if not authorization:
            raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationFailed("Malformed Authorization header: expected 'Bearer <key>'.")
        digest = hashlib.sha256(token.strip().encode("utf-8")).digest()
        match: ApiKeyConfig | None = None
        for stored, key in self._keys:
            if hmac.compare_digest(stored, digest):
                match = key
        if match is None:
            raise AuthenticationFailed("Incorrect API key provided.")
        return self._principals[match.name]

    @staticmethod
    def check_model(principal: Principal, model: str) -> None:
        """Raises PermissionDenied (403, param ``model``) when the key may not use ``model``."""
        if principal.models is not None and model not in principal.models:
            raise PermissionDenied(f"This API key is not allowed to use model '{model}'.", param="model")
