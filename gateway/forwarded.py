"""The client address of a request: the TCP peer, or what ``Forwarded`` / ``X-Forwarded-For`` say when the
peer is a configured trusted proxy.

``trusted_proxies`` (addresses or CIDR networks, empty by default) is the only source of trust; uvicorn's
own ``proxy_headers`` handling is switched off (gateway/server.py), so a loopback peer is not trusted by
default. From a trusted peer the header's hops are read right to left (the nearest proxy appends last),
trusted hops are skipped, and the first other hop is the client. A hop that is not an IP address
(``unknown``, an obfuscated ``_id``, garbage, a 10 KB string) ends the walk and the peer address is used:
``client.ip`` is always an IP (the Elasticsearch template maps it as ``ip``).

``Forwarded`` (RFC 7239 §4-§6: ``for=192.0.2.60;proto=http, for="[2001:db8::17]:4711"``) wins over
``X-Forwarded-For`` when both are present.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
MAX_HEADER_CHARS = 8192
"""Longer forwarding headers are ignored (the peer address is used)."""


def parse_networks(items: Iterable[str]) -> tuple[IPNetwork, ...]:
    """``("10.0.0.0/8", "::1")`` as networks. Raises ValueError naming a bad item."""
    out = []
    for item in items:
        try:
            out.append(ipaddress.ip_network(item.strip(), strict=False))
        except ValueError as exc:
            raise ValueError(f"trusted_proxies: {item!r} is not an IP address or network") from exc
    return tuple(out)


def parse_node(value: str) -> IPAddress | None:
    """An IP from one hop: ``1.2.3.4``, ``1.2.3.4:80``, ``[::1]``, ``[::1]:80``, ``::1`` (quotes stripped);
    None for anything else (``unknown``, ``_hidden``, garbage). An IPv4-mapped IPv6 address
    (``::ffff:1.2.3.4``, RFC 4291 §2.5.5.2: what a dual-stack socket reports for an IPv4 peer) is the IPv4
    address it maps, so it matches IPv4 ``trusted_proxies`` and is logged as ``1.2.3.4``."""
    value = value.strip().strip('"').strip()
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        value = host
    elif value.count(":") == 1:
        host, _, port = value.partition(":")
        if not port.isdigit():
            return None
        value = host
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        return None
    if "%" in str(address):
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


def _split_outside_quotes(text: str, sep: str) -> list[str]:
    parts, current, quoted, escaped = [], [], False, False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\" and quoted:
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == sep and not quoted:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    parts.append("".join(current))
    return parts


def forwarded_for(header: str) -> list[str]:
    """The ``for=`` values of an RFC 7239 ``Forwarded`` header, in order (an element without ``for`` gives
    an empty string, which is not an IP)."""
    hops = []
    for element in _split_outside_quotes(header, ","):
        value = ""
        for pair in _split_outside_quotes(element, ";"):
            name, sep, raw = pair.partition("=")
            if sep and name.strip().lower() == "for":
                value = raw.strip()
        hops.append(value)
    return hops


@dataclass(frozen=True, slots=True)
class ClientAddressResolver:
    """Resolves ``client.ip`` from the peer and the forwarding headers (module docstring)."""

    trusted: tuple[IPNetwork, ...] = ()

    def is_trusted(self, address: IPAddress) -> bool:
        return any(address in network for network in self.trusted)

    def resolve(self, peer: str | None, headers: Sequence[tuple[bytes, bytes]]) -> str | None:
        """The client IP as text; ``peer`` (the TCP peer host) unless it is trusted and a header names a
        valid client."""
        peer_ip = parse_node(peer) if peer else None
        if peer_ip is not None and str(peer_ip) != peer:
            peer = str(peer_ip)  # ::ffff:1.2.3.4 is logged as 1.2.3.4
        if peer_ip is None or not self.trusted or not self.is_trusted(peer_ip):
            return peer
        hops = self._hops(headers)
        if hops is None:
            return peer
        for hop in reversed(hops):
            address = parse_node(hop)
            if address is None:
                return peer
            if not self.is_trusted(address):
                return str(address)
        return str(parse_node(hops[0])) if hops else peer

    @staticmethod
    def _hops(headers: Sequence[tuple[bytes, bytes]]) -> list[str] | None:
        forwarded = [v for k, v in headers if k.lower() == b"forwarded"]
        xff = [v for k, v in headers if k.lower() == b"x-forwarded-for"]
        chosen = forwarded or xff
        if not chosen:
            return None
        text = ",".join(v.decode("latin-1") for v in chosen)
        if len(text) > MAX_HEADER_CHARS:
            return None
        return forwarded_for(text) if forwarded else [hop for hop in text.split(",")]
