"""Where a run's webhooks may go: the address rule their URLs meet when the run is made, and
again whenever a delivery connects (app/services/webhook_delivery.py).

A tenant names the URL, the service POSTs to it from inside its own network and shows how
that went (`GET /v1/runs/{id}/webhooks`). Without a rule that is a request forgery (SSRF)
into the service's network, the Ray dashboard, PostgreSQL or a cloud metadata service, and
a port scanner. So a webhook goes to a public address only: not loopback, private (RFC 1918,
fc00::/7), shared (100.64.0.0/10), link-local, multicast, unspecified or reserved, judged
on the IPv4 address that an IPv4-mapped, 6to4, Teredo or NAT64 IPv6 address carries too.
An operator admits private receivers with TUNEYARD_WEBHOOK_ALLOWED_NETWORKS; a cloud
metadata address is refused whatever it says.

The check when a run is made is advice: a name may resolve elsewhere by the time a delivery
is sent, and a name that does not resolve yet is accepted. The guard is the deliverer's
transport (`guarded_transport`): it resolves the name itself, checks every address, and
connects to an address it checked, while the Host header, TLS SNI and the certificate's
check keep the name.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import ssl
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as ResolveTimeout
from dataclasses import dataclass, field
from typing import Any

import httpcore
import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# What a delivery refused by the rule records as its error: the class, nothing more.
REFUSED = "refused: address not allowed"

# Cloud metadata services (AWS, ECS, EKS Pod Identity, Alibaba Cloud; GCP's and Azure's
# answer at 169.254.169.254): refused even where the allow-list covers them.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",
        "169.254.170.2",
        "169.254.170.23",
        "100.100.100.200",
        "fd00:ec2::254",
        "fd00:ec2::23",
    )
)
METADATA = "a cloud metadata"
# Names that are loopback or metadata by definition, refused without asking DNS.
_REFUSED_NAMES = frozenset({"localhost", "localhost.localdomain", "metadata.google.internal"})
_SHARED = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# IPv4 written as inet_aton reads it (0x7f000001, 2130706433, 127.1): the system resolver
# turns these into addresses without DNS, so the rule must too.
_NUMERIC_IPV4 = re.compile(r"^(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}$", re.I)
_HOST_NAME = re.compile(r"^[a-z0-9_-]+(\.[a-z0-9_-]+)*$")
# How long validating a run waits for DNS before taking the name as unresolved.
RESOLVE_TIMEOUT_S = 2.0
_resolvers = ThreadPoolExecutor(4, thread_name_prefix="tuneyard-webhook-dns")


def resolve(host: str, port: int) -> list[IPAddress]:
    """The addresses the system resolver gives `host`, in its order. Tests substitute this
    module attribute: everything here looks it up when it resolves."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))


def normal_host(host: str) -> str:
    return host.strip("[]").lower().removesuffix(".")


def literal_address(host: str) -> IPAddress | None:
    """The address a host that is an IP literal in any form names, or None for a name."""
    bare = normal_host(host)
    try:
        return ipaddress.ip_address(bare.split("%", 1)[0])
    except ValueError:
        pass
    if _NUMERIC_IPV4.match(bare):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(bare))
        except OSError:
            return None
    return None


def _carried(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries and is routed to, if it carries one."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def address_kind(address: IPAddress) -> str | None:
    """What kind of address webhooks may not reach `address` is ("loopback", "private",
    ...), or None for a public one. An IPv6 address that carries an IPv4 one is judged by
    the address it reaches (NAT64 on an IPv6-only network reaches public ones too)."""
    if address in METADATA_ADDRESSES:
        return METADATA
    reached = _carried(address) or address
    if reached in METADATA_ADDRESSES:
        return METADATA
    for kind, hit in (
        ("loopback", reached.is_loopback),
        ("link-local", reached.is_link_local),
        ("multicast", reached.is_multicast),
        ("unspecified", reached.is_unspecified),
        ("shared (100.64.0.0/10)", reached in _SHARED),
        ("private", reached.is_private),
        # fec0::/10, deprecated (RFC 3879) yet still routed inside some networks, which
        # Python counts as global.
        ("site-local", isinstance(reached, ipaddress.IPv6Address) and reached.is_site_local),
        ("reserved", reached.is_reserved),
        ("non-public", not reached.is_global),
    ):
        if hit:
            return kind
    return None


@dataclass(frozen=True, slots=True)
class AddressPolicy:
    """The rule, with the operator's allow-list (TUNEYARD_WEBHOOK_ALLOWED_NETWORKS): private
    networks and host names webhooks may reach besides public addresses."""

    networks: tuple[IPNetwork, ...] = ()
    hosts: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AddressPolicy:
        """From the setting's entries: CIDRs or addresses (10.0.0.0/8, 127.0.0.1, fd12::/16),
        or host names (a listed name may resolve anywhere but a metadata address)."""
        networks: list[IPNetwork] = []
        hosts: set[str] = set()
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry.strip(), strict=False))
                continue
            except ValueError:
                pass
            host = normal_host(entry.strip())
            if not _HOST_NAME.match(host) or literal_address(host) is not None:
                raise ValueError(
                    f"{entry!r} is neither a network (CIDR), an address nor a host name"
                )
            hosts.add(host)
        return cls(tuple(networks), frozenset(hosts))

    def name_refused(self, host: str) -> bool:
        """Whether `host` is a name refused as such (localhost, *.localhost, the metadata
        name), unless the operator listed it."""
        host = normal_host(host)
        refused = host in _REFUSED_NAMES or host.endswith(".localhost")
        return refused and host not in self.hosts

    def refusal(self, host: str, address: IPAddress) -> str | None:
        """Why a delivery to `host` may not connect to `address` (its kind), or None."""
        kind = address_kind(address)
        if kind is None or kind == METADATA:
            return kind
        if normal_host(host) in self.hosts:
            return None
        carried = _carried(address)
        for network in self.networks:
            if address in network or (carried is not None and carried in network):
                return None
        return kind


OPERATOR_HINT = (
    "webhooks go to public addresses only (an operator admits private receivers with "
    "TUNEYARD_WEBHOOK_ALLOWED_NETWORKS)"
)


def destination_problem(url: str, policy: AddressPolicy) -> str | None:
    """Why a run may not have a webhook at `url` (which parses: the schema checked it), or
    None. A name that does not resolve now is accepted: the deliverer checks again on every
    connection, which is the guard, since DNS may answer differently by then."""
    parsed = httpx.URL(url)
    host = normal_host(parsed.host)
    if policy.name_refused(host):
        return f"{host!r} is a loopback or metadata name: {OPERATOR_HINT}"
    literal = literal_address(host)
    if literal is not None:
        if kind := policy.refusal(host, literal):
            return f"{host!r} is {_article(kind)} address: {OPERATOR_HINT}"
        return None
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        addresses = _resolvers.submit(lambda: resolve(host, port)).result(RESOLVE_TIMEOUT_S)
    except (OSError, UnicodeError, ResolveTimeout):
        return None
    if any(policy.refusal(host, address) for address in addresses):
        # Which address, or its kind, is not said: that would map the internal network.
        return f"{host!r} resolves to an address webhooks may not reach: {OPERATOR_HINT}"
    return None


def _article(kind: str) -> str:
    return kind if kind.startswith("a ") else f"a {kind}"


class AddressRefused(Exception):
    """A delivery's destination broke the rule when it was about to connect."""


def checked_addresses(host: str, port: int, policy: AddressPolicy) -> list[IPAddress]:
    """The addresses a delivery to `host` may connect to: all of them, or AddressRefused if
    any is refused (a name that points inside is refused, whatever else it points at)."""
    if policy.name_refused(host):
        raise AddressRefused(REFUSED)
    literal = literal_address(host)
    addresses = [literal] if literal is not None else resolve(normal_host(host), port)
    if not addresses or any(policy.refusal(host, address) for address in addresses):
        raise AddressRefused(REFUSED)
    return addresses


# A name with several addresses: the first few are tried, each with the connect timeout.
MAX_ADDRESSES_TRIED = 3


class GuardedBackend(httpcore.NetworkBackend):
    """httpcore's network backend with the rule in front: `connect_tcp` gets the URL's host,
    checks what it resolves to, and opens the socket to a checked address itself, so no
    second lookup can answer differently. httpcore then starts TLS on that socket with the
    URL's host as the server name (SNI, certificate check), and the request keeps its Host."""

    def __init__(self, policy: AddressPolicy, *, total_s: float | None = None) -> None:
        """`total_s`: how long one connection may take in all, from connect to the answer's
        last byte read (each connection carries one delivery: see guarded_transport)."""
        self._policy = policy
        self._system = httpcore.SyncBackend()
        self._total_s = total_s

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        try:
            addresses = checked_addresses(host, port, self._policy)
        except (OSError, UnicodeError) as exc:  # the name does not resolve
            raise httpcore.ConnectError(str(exc)) from exc
        deadline = None if self._total_s is None else time.monotonic() + self._total_s
        error: Exception | None = None
        for address in addresses[:MAX_ADDRESSES_TRIED]:
            try:
                stream = self._system.connect_tcp(
                    str(address), port, _within(timeout, deadline), local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
                continue
            return stream if deadline is None else DeadlineStream(stream, deadline)
        assert error is not None
        raise error

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        raise AddressRefused(REFUSED)

    def sleep(self, seconds: float) -> None:
        self._system.sleep(seconds)


def _within(timeout: float | None, deadline: float | None) -> float | None:
    """An operation's timeout, cut to what is left before `deadline` (ReadTimeout if
    nothing is)."""
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise httpcore.ReadTimeout("the delivery's time is up")
    return left if timeout is None else min(timeout, left)


class DeadlineStream(httpcore.NetworkStream):
    """A connection with a deadline for all it does: httpx's timeouts bound each read and
    write, so a receiver that answers a byte at a time would hold a send thread for as
    long as it liked."""

    def __init__(self, stream: httpcore.NetworkStream, deadline: float) -> None:
        self._stream = stream
        self._deadline = deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _within(timeout, self._deadline))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _within(timeout, self._deadline))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        tls = self._stream.start_tls(ssl_context, server_hostname, _within(timeout, self._deadline))
        return DeadlineStream(tls, self._deadline)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


def guarded_transport(
    policy: AddressPolicy, *, verify: ssl.SSLContext | bool = True, total_s: float | None = None
) -> httpx.HTTPTransport:
    """An httpx transport whose every connection meets the rule, made anew for each request
    (no keep-alive: the checked address and the deadline are a connection's), and takes
    at most `total_s` in all. Environment proxies are not used: a proxy would resolve the
    name itself."""
    transport = httpx.HTTPTransport(verify=verify, trust_env=False)
    # httpx's transport takes no network backend but sends through its httpcore pool: the
    # same pool, made with the guarded backend.
    transport._pool = httpcore.ConnectionPool(
        ssl_context=httpx.create_ssl_context(verify=verify, trust_env=False),
        max_connections=100,
        max_keepalive_connections=0,
        network_backend=GuardedBackend(policy, total_s=total_s),
    )
    return transport
