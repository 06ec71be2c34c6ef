"""Who may call: the API key, who must have it, and the checks that keep web pages of other sites out of a server on
this machine.

Exposure: a server reachable from other machines (a --host that is not loopback) needs a key, or --insecure to serve
without one; `check_exposure` refuses the options otherwise, before anything loads (`astrai serve` calls it).

The key: with `astrai serve --api-key KEY`, every /v1/ route needs 'Authorization: Bearer KEY' (what the openai
client sends) or 'x-api-key: KEY' (what the anthropic client sends). /health, /metrics and the chat page (GET /)
stay open.

Other sites: a keyless server on loopback (the default) is reachable from any web page the user opens. A page
may POST a "simple" request (text/plain, no preflight) to http://127.0.0.1:8000, or rename itself to that address
(DNS rebinding) and read the answers. So, as Jupyter and Docker do for their loopback services:

    Host     every route: a name or address this server is reached by (localhost, *.localhost, loopback
             addresses, the --host it is bound to, any IP address when bound to all of them, each --allowed-host),
             else 403. A rebinding page's requests carry its own name.
    Origin   the /v1/ routes: absent (not a browser), the server's own (the chat page), or an --allowed-host's
             (a proxy that rewrites Host), else 403.
    Content-Type  the POST routes: application/json (which a page of another site cannot send without a CORS
             preflight, which this server never grants), else 415.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from typing import Mapping, Sequence
from urllib.parse import urlsplit

from fastapi import Depends, Request

from serving.errors import ApiError

WILDCARD_BINDS = ("0.0.0.0", "::", "")  # bound to every address of the machine


def check_key(headers: Mapping[str, str], api_key: str | None) -> None:
    """Raises ApiError 401 unless `headers` (lower-case names) carry `api_key`; no key set: anything passes."""
    if api_key is None:
        return
    bearer = headers.get("authorization", "")
    given = [bearer[7:].strip() if bearer[:7].lower() == "bearer " else "", headers.get("x-api-key", "")]
    if not any(hmac.compare_digest(g.encode(), api_key.encode()) for g in given if g):
        raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')")


@dataclass(frozen=True)
class Hosts:
    """The names a server answers to: `bound` is its --host, `allowed` the --allowed-host names ("*": any)."""
    bound: str = "127.0.0.1"
    allowed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed", tuple(name.lower().strip("[]") for name in self.allowed))

    def serves(self, hostname: str) -> bool:
        """Whether a request's Host names this server (`hostname`: lower-case, no port, no brackets)."""
        if hostname == self.bound.lower().strip("[]") or is_loopback(hostname) or hostname.endswith(".localhost"):
            return True
        if "*" in self.allowed or hostname in self.allowed:
            return True
        try:
            ipaddress.ip_address(hostname)
        except ValueError:
            return False
        return self.bound in WILDCARD_BINDS  # any address of the machine


def hostname_of(netloc: str) -> str | None:
    """'Example.org:8000' -> 'example.org', '[::1]:80' -> '::1'; None when it is no host."""
    try:
        return urlsplit(f"//{netloc}").hostname
    except ValueError:
        return None


def check_host(headers: Mapping[str, str], hosts: Hosts) -> None:
    """403 unless the Host header names this server (no Host: not a browser, nothing to check)."""
    host = headers.get("host")
    if host is not None and not ((name := hostname_of(host)) and hosts.serves(name)):
        raise ApiError(403, f"Host {host[:100]!r} is not a name of this server (a page of another site?); start "
                            "the server with --allowed-host NAME to accept it")


def check_origin(headers: Mapping[str, str], hosts: Hosts) -> None:
    """403 when a browser sends the request from a page of another origin than this server (or an allowed host)."""
    origin = headers.get("origin")
    if origin is None:
        return
    parts = urlsplit(origin) if origin != "null" else None
    same = parts is not None and parts.netloc.lower() == headers.get("host", "").lower()
    if not same and not (parts and parts.hostname and ("*" in hosts.allowed or parts.hostname in hosts.allowed)):
        raise ApiError(403, f"Origin {origin[:100]!r}: requests from pages of other sites are refused; start the "
                            "server with --allowed-host NAME to accept that site's pages")


def check_json(headers: Mapping[str, str]) -> None:
    """415 unless the body is declared application/json (a page of another site can send text/plain unasked)."""
    media_type = headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(415, f"Content-Type must be application/json, not {media_type or 'missing'!r}")


# --- route dependencies (create_app keeps api_key and hosts on app.state) --------------------------------------
# async: FastAPI runs a plain `def` dependency in its thread pool, a round trip per check and request.

async def require_host(request: Request) -> None:
    check_host(request.headers, request.app.state.hosts)


async def require_origin(request: Request) -> None:
    check_origin(request.headers, request.app.state.hosts)


async def require_key(request: Request) -> None:
    check_key(request.headers, request.app.state.api_key)


async def require_json(request: Request) -> None:
    check_json(request.headers)


API = [Depends(require_origin), Depends(require_key)]  # every /v1/ route (the app adds require_host to every route)


def is_loopback(host: str) -> bool:
    """Whether `host` is "localhost" or a loopback address (127.0.0.0/8, ::1): only this machine reaches it."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None, insecure: bool, allowed_hosts: Sequence[str]) -> str | None:
    """The key a server bound to `host` requires (None: none; an empty key is none), once `astrai serve`'s options
    pass: ValueError naming the option when the key cannot be sent in an HTTP header, an --allowed-host is not a
    bare host name (or "*"), or `host` is reachable from other machines with neither a key nor `insecure`."""
    api_key = api_key or None  # an empty ASTRAI_API_KEY means no key
    if api_key is not None and not all("!" <= ch <= "~" for ch in api_key):
        # HTTP header values are ASCII: no client could send such a key (httpx refuses to encode it).
        raise ValueError("--api-key (or ASTRAI_API_KEY): only printable ASCII characters without spaces can be sent "
                         "in an HTTP header")
    if bad := [n for n in allowed_hosts if n != "*" and hostname_of(n) != n.lower().strip("[]")]:
        raise ValueError(f"--allowed-host {bad[0]!r}: expected a host name or address without scheme or port (or '*')")
    if not (is_loopback(host) or api_key or insecure):
        raise ValueError(f"--host {host} is reachable from other machines: set --api-key (or ASTRAI_API_KEY), or pass "
                         "--insecure to serve without a key")
    return api_key
