"""Leaving through the network: the session's proxies are the only way out of the sandbox, and
they refuse every host the session's allowlist does not name.

Each test runs real clients inside a real sandbox against a local upstream HTTP server on the
host's loopback (what an escape would reach): curl, and a raw client in /usr/bin/python3 that
speaks CONNECT, absolute-form HTTP and SOCKS5 byte by byte, so that a spelling reaches the proxy
exactly as written (curl rewrites `0x7f.1` to `127.0.0.1` before sending it). A refused attempt
must fail in-protocol, be recorded as exactly one `network-outbound` violation on the handle (and
as an event of the command that made it), and never reach the upstream; a positive control shows
the same route working where the allowlist says it may.

Names are resolved by a fake resolver (`FakeDns`), so nothing here looks anything up, and nothing
dials anything but the test's own servers on 127.0.0.1 and ::1. The only other addresses in these
tests are never dialled: 1.1.1.1 is tried directly from inside, where the namespace has no route,
and 93.184.216.34 and GitHub's names are refused by the proxy before any lookup or connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.server
import ipaddress
import json
import os
import re
import secrets
import shutil
import socket
import stat
import threading
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from escape_kit import (
    RUN_TIMEOUT_S,
    Sandboxes,
    attempts,
    host_pids_with,
    outcomes,
    output,
    unique,
    wait_until,
)

from cc_server.backends.egress_bridge import BRIDGE_DIR, HTTP_PROXY_PORT, SOCKS_PROXY_PORT
from cc_server.backends.probe import CREATE_LAUNCHER_TOOL, ProbeResult
from cc_server.egress.addresses import IPAddress
from cc_server.policy import parse_spec
from cc_server.runtime.egress import egress_base_dir
from cc_server.runtime.events import SandboxState
from cc_server.runtime.handle import CollectedResult, SandboxHandle, run_collect
from cc_server.runtime.port import SandboxManager
from cc_server.runtime.select import WRITE_PROTECTION_ENV

pytestmark = [pytest.mark.security, pytest.mark.integration]

PY = "/usr/bin/python3"  # the host's pyenv python lives under /root, which the sandbox cannot see
CURL = "curl -sS -i -m 5"
# curl honours NO_PROXY (the bridge sets 127.0.0.1 and ::1 in it) even with -x; '' overrides it.
VIA_HTTP_CONNECT = f"-p -x http://127.0.0.1:{HTTP_PROXY_PORT} --noproxy ''"
VIA_SOCKS_NAME = f"--noproxy '' --socks5-hostname 127.0.0.1:{SOCKS_PROXY_PORT}"
VIA_SOCKS_IP = f"--noproxy '' --socks5 127.0.0.1:{SOCKS_PROXY_PORT}"
CURL_COULDNT_CONNECT = 7  # curl's exit code: the TCP connection itself failed
CURL_TUNNEL_FAILED = 56  # curl's exit code: the proxy answered CONNECT with a non-2xx status
CURL_PROXY_HANDSHAKE = 97  # curl's exit code: the SOCKS proxy refused the request
SOCKS_NOT_ALLOWED = 0x02  # RFC 1928 REP: connection not allowed by ruleset
DENIED_HEADER = re.compile(r"(?im)^X-Cc-Server-Egress: denied\r?$")
BRIDGE_ARGV = f"UNIX-CONNECT:{BRIDGE_DIR}".encode()  # in the argv of each socat listener
STALE_PID = 999_999  # above this host's pid_max; the test checks it is not a live process

LOOPBACK = ipaddress.ip_address("127.0.0.1")
METADATA = ipaddress.ip_address("169.254.169.254")
ALLOWED = "allowed.test"  # resolves to the upstream; reachable when 127.0.0.1 is listed too
DENIED = "denied.test"  # resolves to the upstream as well, and is on no allowlist
META_NAME = "meta.test"  # resolves to instance metadata
LOOP_NAME = "loop.test"  # resolves to the host's loopback

# The raw client. argv[1]: a JSON list of attempts (see `attempt`). One JSON line per attempt:
# {"reply": the HTTP proxy's reply and, if a tunnel opened, the upstream's} or {"rep": the SOCKS
# REP code, "reply": the upstream's answer when it is 0} or {"error": the OSError}.
RAW_CLIENT = r"""
import json, socket, sys

def dial(proxy, over):
    if over == "unix":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect("/run/cc-egress/" + ("http.sock" if proxy == "http" else "socks.sock"))
        return s
    return socket.create_connection(("127.0.0.1", 3128 if proxy == "http" else 1080), timeout=5)

def rest(s, data=b""):
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return data
        data += chunk

def exactly(s, n):
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data

def attempt(a):
    kind, host, port = a["kind"], a["host"], a["port"]
    authority = f"{host}:{port}"
    get = f"GET / HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode()
    with dial("http" if kind in ("connect", "forward") else "socks", a["over"]) as s:
        if kind == "connect":
            s.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = s.recv(65536)
                if not chunk:
                    break
                head += chunk
            if head.startswith(b"HTTP/1.1 200"):
                s.sendall(get)
            return {"reply": rest(s, head).decode("latin-1")}
        if kind == "forward":
            host_header = a.get("host_header") or authority
            s.sendall(
                f"GET http://{authority}/ HTTP/1.1\r\nHost: {host_header}\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            return {"reply": rest(s).decode("latin-1")}
        s.sendall(b"\x05\x01\x00")
        if exactly(s, 2) != b"\x05\x00":
            return {"rep": None}
        if kind == "socks-domain":
            address = b"\x03" + bytes([len(host)]) + host.encode()
        elif kind == "socks-ipv4":
            address = b"\x01" + socket.inet_pton(socket.AF_INET, host)
        else:
            address = b"\x04" + socket.inet_pton(socket.AF_INET6, host)
        s.sendall(b"\x05\x01\x00" + address + port.to_bytes(2, "big"))
        reply = exactly(s, 10)
        if len(reply) < 2:
            return {"rep": None}
        if reply[1] != 0:
            return {"rep": reply[1]}
        s.sendall(get)
        return {"rep": 0, "reply": rest(s).decode("latin-1")}

for a in json.loads(sys.argv[1]):
    try:
        out = attempt(a)
    except OSError as exc:
        out = {"error": repr(exc)}
    out["name"] = a["name"]
    print(json.dumps(out), flush=True)
"""

# Inside: every socket of the network namespace, and a direct connection with no route.
NAMESPACE_SOCKETS = r"""
import errno, json, socket
found = {}
for name in ("tcp", "tcp6", "udp", "udp6", "raw", "raw6"):
    with open("/proc/net/" + name) as f:
        found[name] = [line.split()[1:4] for line in f.readlines()[1:]]
try:
    socket.create_connection(("1.1.1.1", 80), timeout=3).close()
    found["no_route"] = "connected"
except OSError as exc:
    found["no_route"] = errno.errorcode.get(exc.errno, repr(exc))
print(json.dumps(found))
"""


# --- the host side: an upstream to reach, and a resolver ---------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _UpstreamServer

    def do_GET(self) -> None:
        self.server.seen.append(self.headers.get("Host", ""))
        body = self.server.body
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _UpstreamServer(http.server.ThreadingHTTPServer):
    def __init__(self, address: tuple[str, int], body: bytes, seen: list[str]) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.body = body
        self.seen = seen
        super().__init__(address, _Handler)


@dataclass
class Upstream:
    """HTTP servers on the host's 127.0.0.1 and ::1: every GET gets `marker`, and the Host
    header of every request they ever see is kept in `seen`."""

    marker: str
    port: int  # on 127.0.0.1
    port6: int  # on ::1
    seen: list[str]


@contextlib.contextmanager
def open_upstream() -> Iterator[Upstream]:
    marker = unique("cc-upstream")
    seen: list[str] = []
    servers = [
        _UpstreamServer((address, 0), marker.encode(), seen) for address in ("127.0.0.1", "::1")
    ]
    threads = [
        threading.Thread(target=server.serve_forever, name=f"upstream {i}", daemon=True)
        for i, server in enumerate(servers)
    ]
    for thread in threads:
        thread.start()
    try:
        yield Upstream(
            marker=marker,
            port=servers[0].server_address[1],
            port6=servers[1].server_address[1],
            seen=seen,
        )
    finally:
        for server, thread in zip(servers, threads, strict=True):
            server.shutdown()
            server.server_close()
            thread.join()


@dataclass
class FakeDns:
    """The proxies' resolver: fixed answers, and every name it was asked for."""

    answers: dict[str, list[IPAddress]]
    asked: list[str] = field(default_factory=list)

    async def __call__(self, host: str, port: int) -> list[IPAddress]:
        self.asked.append(host)
        return list(self.answers.get(host, []))


@dataclass
class Lab:
    """Sandboxes whose proxies resolve through `dns`, and the upstream they may reach."""

    sb: Sandboxes
    dns: FakeDns
    upstream: Upstream

    def launch(self, **fields: Any) -> SandboxHandle:
        return self.sb.launch(**fields)

    async def sh(self, handle: SandboxHandle, script: str) -> CollectedResult:
        return await self.sb.sh(handle, script)


def socat_only(probe_result: ProbeResult) -> ProbeResult:
    """This host's probe without the launcher: the fallback bridge (socat and bound sockets)."""
    tools = {k: v for k, v in probe_result.tools.items() if k != CREATE_LAUNCHER_TOOL}
    return dataclasses.replace(probe_result, tools=tools, create_rules=False)


@contextlib.asynccontextmanager
async def open_lab(sb: Sandboxes, probe_result: ProbeResult) -> AsyncIterator[Lab]:
    dns = FakeDns(
        {
            ALLOWED: [LOOPBACK],
            DENIED: [LOOPBACK],
            META_NAME: [METADATA],
            LOOP_NAME: [LOOPBACK],
        }
    )
    with open_upstream() as upstream:
        manager = SandboxManager(
            probe_result=probe_result, host=sb.manager.host, egress_resolver=dns
        )
        sandboxes = Sandboxes(
            root=sb.root,
            home=sb.home,
            worktree=sb.worktree,
            secret_marker=sb.secret_marker,
            manager=manager,
        )
        try:
            yield Lab(sb=sandboxes, dns=dns, upstream=upstream)
        finally:
            await manager.aclose()


@pytest.fixture(params=["handoff", "socat"])
async def lab(
    sb: Sandboxes, probe_result: ProbeResult, request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Lab]:
    """Every egress test runs over both bridges: the launcher's loopback listeners handed to the
    proxies (this host has the launcher), and the socat fallback for hosts without it (where a
    launch runs only with the write policy's launch-time binds, said on purpose)."""
    if request.param == "handoff":
        assert CREATE_LAUNCHER_TOOL in probe_result.tools, "the launcher is not built"
    else:
        monkeypatch.setenv(WRITE_PROTECTION_ENV, "launch-time")
    chosen = probe_result if request.param == "handoff" else socat_only(probe_result)
    async with open_lab(sb, chosen) as lab:
        yield lab


@pytest.fixture
async def socat_lab(
    sb: Sandboxes, probe_result: ProbeResult, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Lab]:
    monkeypatch.setenv(WRITE_PROTECTION_ENV, "launch-time")  # a host without the launcher
    async with open_lab(sb, socat_only(probe_result)) as lab:
        yield lab


# --- helpers ---------------------------------------------------------------------------------


def attempt(
    name: str, kind: str, host: str, port: int, over: str = "tcp", host_header: str = ""
) -> dict[str, Any]:
    """One raw-client attempt: `kind` is connect | forward (HTTP proxy) or socks-domain |
    socks-ipv4 | socks-ipv6; `host` is sent exactly as written; `over` is tcp (the loopback
    listeners) or unix (the bridge sockets in BRIDGE_DIR); `host_header` replaces a forwarded
    request's Host header (by default it names the target)."""
    return {
        "name": name,
        "kind": kind,
        "host": host,
        "port": port,
        "over": over,
        "host_header": host_header,
    }


async def run_raw(
    handle: SandboxHandle, *tries: dict[str, Any]
) -> tuple[dict[str, dict[str, Any]], CollectedResult]:
    """Run the raw client once with `tries`; its results by attempt name, and the run."""
    result = await run_collect(
        handle, [PY, "-c", RAW_CLIENT, json.dumps(list(tries))], timeout_s=RUN_TIMEOUT_S
    )
    assert result.killed is None and result.exit_code == 0, output(result)
    found = {}
    for line in result.stdout.decode().splitlines():
        entry = json.loads(line)
        found[entry.pop("name")] = entry
    assert sorted(found) == sorted(t["name"] for t in tries), output(result)
    return found, result


def refused(entry: dict[str, Any]) -> bool:
    """A raw-client result that is the proxy's refusal: HTTP 403 with the egress header, or
    SOCKS REP 0x02."""
    if "rep" in entry:
        return entry["rep"] == SOCKS_NOT_ALLOWED and "reply" not in entry
    reply = entry.get("reply", "")
    return reply.startswith("HTTP/1.1 403 ") and DENIED_HEADER.search(reply) is not None


def reached(entry: dict[str, Any], upstream: Upstream) -> bool:
    return upstream.marker in entry.get("reply", "")


def split_target(target: str) -> tuple[IPAddress | str, int]:
    """A violation's `host:port` target as (address or name, port)."""
    host, _, port = target.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    try:
        return ipaddress.ip_address(host), int(port)
    except ValueError:
        return host, int(port)


def assert_violations(
    handle: SandboxHandle,
    expected: list[tuple[IPAddress | str, int]],
    suggested: str | None = None,
) -> None:
    """Exactly one network-outbound violation per refusal, in order, with these targets."""
    seen = handle.violations
    assert [split_target(v.target) for v in seen] == expected, seen
    assert all(v.action == "network-outbound" for v in seen), seen
    assert all(v.suggested_capability == suggested for v in seen), seen
    assert all(v.raw and "egress refused" in v.raw for v in seen), seen


def netns_pids(netns: str) -> dict[int, list[bytes]]:
    """Host processes in network namespace `netns` (`net:[inode]`), with their argv."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/net") == netns:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found[int(entry)] = f.read().split(b"\0")
        except OSError:
            continue
    return found


def bridge_pids(netns: str) -> list[int]:
    """The socat listeners of the bridge in network namespace `netns`."""
    return [
        pid
        for pid, argv in netns_pids(netns).items()
        if os.path.basename(argv[0]) == b"socat" and any(BRIDGE_ARGV in a for a in argv)
    ]


def proxy_listeners(netns: str) -> dict[int, list[int]]:
    """The loopback proxy listeners (ports 3128 and 1080) of network namespace `netns`, by
    socket inode, each with the host pids holding an fd to it."""
    inside = next(iter(netns_pids(netns)), None)
    if inside is None:
        return {}
    wanted = {f"0100007F:{port:04X}" for port in (HTTP_PROXY_PORT, SOCKS_PROXY_PORT)}
    inodes: dict[int, list[int]] = {}
    with contextlib.suppress(OSError), open(f"/proc/{inside}/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1] in wanted and fields[3] == "0A":
                inodes[int(fields[9])] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                for inode in proxy_listeners_held_by(int(entry), inodes):
                    inodes[inode].append(int(entry))
    return inodes


def proxy_listeners_held_by(pid: int, inodes: Iterable[int]) -> list[int]:
    """Which of the socket `inodes` process `pid` still holds an fd to."""
    wanted = {f"socket:[{inode}]": inode for inode in inodes}
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target in wanted:
                held.append(wanted[target])
    return held


def refuses_tcp(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


# --- no way around the proxies ---------------------------------------------------------------


async def test_direct_connections_reach_nothing(lab: Lab) -> None:
    up = lab.upstream
    handle = lab.launch(egressAllowlist=[ALLOWED, "127.0.0.1"])
    direct = "curl -sS -m 5 --noproxy '*'"
    result = await lab.sh(
        handle,
        f"""
        {PY} -c '{NAMESPACE_SOCKETS}'
        {direct} http://127.0.0.1:{up.port}/; echo "host_v4=$?"
        {direct} http://[::1]:{up.port6}/; echo "host_v6=$?"
        {direct} http://1.1.1.1:80/; echo "no_route=$?"
        curl -sS -m 5 http://{ALLOWED}:{up.port}/; echo " control=$?"
        """,
    )
    text = output(result)
    codes = dict(re.findall(r"(\w+)=(\d+)$", text, re.MULTILINE))
    # Control: the same curl, through the proxy the environment names, reaches the upstream.
    assert codes.pop("control") == "0" and up.marker in text, text
    assert codes == dict.fromkeys(codes, str(CURL_COULDNT_CONNECT)) and len(codes) == 3, text
    sockets = json.loads(text.splitlines()[0])
    assert sockets.pop("no_route") == "ENETUNREACH", text  # no route: fails at once, not later
    # The namespace's only sockets are the bridge's two listeners on 127.0.0.1.
    listening = "0A"
    assert sorted(sockets.pop("tcp")) == sorted(
        [f"0100007F:{port:04X}", "00000000:0000", listening]
        for port in (HTTP_PROXY_PORT, SOCKS_PROXY_PORT)
    ), text
    assert all(found == [] for found in sockets.values()), text
    assert up.seen == [f"{ALLOWED}:{up.port}"]  # only the control reached the host
    assert handle.violations == []  # nothing went through the proxy but the control


ROUTES = {
    # route: (curl options, allowed host, denied host)
    "http-env-forward": ("", ALLOWED, DENIED),
    "http-connect": (VIA_HTTP_CONNECT, ALLOWED, DENIED),
    "socks5-hostname": (VIA_SOCKS_NAME, ALLOWED, DENIED),
    "socks5-ip": (VIA_SOCKS_IP, "127.0.0.1", "127.0.0.2"),
}


@pytest.mark.parametrize("route", list(ROUTES))
async def test_an_allowed_host_passes_and_an_unlisted_one_is_refused(lab: Lab, route: str) -> None:
    up = lab.upstream
    options, allowed, denied = ROUTES[route]
    handle = lab.launch(egressAllowlist=[ALLOWED, "127.0.0.1"])
    control = await lab.sh(handle, f"{CURL} {options} http://{allowed}:{up.port}/")
    assert control.exit_code == 0 and up.marker in output(control), output(control)
    assert up.seen == [f"{allowed}:{up.port}"]

    result = await lab.sh(handle, f"{CURL} {options} http://{denied}:{up.port}/")
    text = output(result)
    assert up.marker not in text, text
    if route.startswith("http"):
        # The proxy answers in-protocol: a 403 the client can read, and a header that says why.
        expected_exit = 0 if route == "http-env-forward" else CURL_TUNNEL_FAILED
        assert result.exit_code == expected_exit, text
        assert text.startswith("HTTP/1.1 403 ") and DENIED_HEADER.search(text), text
        assert "not on this session's egress allowlist" in text, text
    else:
        assert result.exit_code == CURL_PROXY_HANDSHAKE, text
    assert up.seen == [f"{allowed}:{up.port}"], "the refused request reached the upstream"
    target = split_target(f"{denied}:{up.port}")
    assert_violations(handle, [target])
    # The command that was refused saw the violation as an event too.
    assert [split_target(v.target) for v in result.violations] == [target]


async def test_a_forwarded_request_cannot_name_another_host(lab: Lab) -> None:
    # Plain HTTP through the proxy: the allowlist judges the request target, and the Host header
    # (what a shared front end routes by) must name the same host, so an allowed name cannot
    # carry a request for an unlisted one.
    up = lab.upstream
    handle = lab.launch(egressAllowlist=[ALLOWED, "127.0.0.1"])
    found, _ = await run_raw(
        handle,
        attempt("control", "forward", ALLOWED, up.port),
        attempt("fronted", "forward", ALLOWED, up.port, host_header=f"{DENIED}:{up.port}"),
        attempt("reversed", "forward", DENIED, up.port, host_header=f"{ALLOWED}:{up.port}"),
    )
    assert reached(found.pop("control"), up), found
    assert not any(reached(entry, up) for entry in found.values()), found
    assert found["fronted"]["reply"].startswith("HTTP/1.1 400 "), found
    assert found["reversed"]["reply"].startswith(("HTTP/1.1 400 ", "HTTP/1.1 403 ")), found
    assert up.seen == [f"{ALLOWED}:{up.port}"]


SPELLINGS = {
    # label: (host as the HTTP client writes it, as a SOCKS domain, what it means, upstream)
    "metadata": ("169.254.169.254", "169.254.169.254", METADATA, "v4"),
    "decimal": ("2130706433", "2130706433", LOOPBACK, "v4"),
    "hex-short": ("0x7f.1", "0x7f.1", LOOPBACK, "v4"),
    "octal": ("0177.0.0.1", "0177.0.0.1", LOOPBACK, "v4"),
    "short": ("127.1", "127.1", LOOPBACK, "v4"),
    "mapped-metadata": (
        "[::ffff:169.254.169.254]",
        "::ffff:169.254.169.254",
        ipaddress.ip_address("::ffff:169.254.169.254"),
        "v4",
    ),
    "ipv6-loopback": ("[::1]", "::1", ipaddress.ip_address("::1"), "v6"),
    "name-to-metadata": (META_NAME, META_NAME, META_NAME, "v4"),
    "name-to-loopback": (LOOP_NAME, LOOP_NAME, LOOP_NAME, "v4"),
}


@pytest.mark.parametrize("label", list(SPELLINGS))
async def test_metadata_and_loopback_are_refused_in_every_spelling(lab: Lab, label: str) -> None:
    up = lab.upstream
    http_host, socks_host, meaning, upstream = SPELLINGS[label]
    # A dial would reach the upstream: the loopback spellings point at its port.
    port = up.port6 if upstream == "v6" else up.port
    # The names are allowlisted, so what refuses them is the check of the addresses they resolve
    # to; the literals are refused because no literal is listed.
    handle = lab.launch(egressAllowlist=[META_NAME, LOOP_NAME])
    tries = [
        attempt("connect", "connect", http_host, port),
        attempt("forward", "forward", http_host, port),
        attempt("socks-domain", "socks-domain", socks_host, port),
    ]
    if not isinstance(meaning, str):
        kind = "socks-ipv4" if meaning.version == 4 else "socks-ipv6"
        tries.append(attempt("socks-address", kind, str(meaning), port))
    found, _ = await run_raw(handle, *tries)
    assert all(refused(entry) for entry in found.values()), found
    # curl, as an agent would use it (it normalises the spelling before sending it).
    result = await lab.sh(
        handle,
        attempts(
            curl_connect=f"{CURL} {VIA_HTTP_CONNECT} http://{http_host}:{port}/",
            curl_socks=f"{CURL} {VIA_SOCKS_NAME} http://{http_host}:{port}/",
        ),
    )
    assert outcomes(result) == {"curl_connect": "fail", "curl_socks": "fail"}, output(result)
    assert up.seen == [], "a refused spelling reached the upstream"
    assert_violations(handle, [(meaning, port)] * (len(tries) + 2))
    assert lab.dns.asked == ([meaning] * (len(tries) + 2) if isinstance(meaning, str) else [])


async def test_a_listed_loopback_literal_is_matched_in_every_spelling(lab: Lab) -> None:
    # The control for the test above: with the literals listed, the same spellings reach the
    # upstream, so what refused them there was the address, not a parse or handshake failure.
    up = lab.upstream
    handle = lab.launch(egressAllowlist=["127.0.0.1", "::1", LOOP_NAME])
    tries = []
    for label in ("decimal", "hex-short", "octal", "short", "ipv6-loopback", "name-to-loopback"):
        http_host, socks_host, _, upstream = SPELLINGS[label]
        port = up.port6 if upstream == "v6" else up.port
        tries += [
            attempt(f"connect {label}", "connect", http_host, port),
            attempt(f"socks {label}", "socks-domain", socks_host, port),
        ]
    found, _ = await run_raw(handle, *tries)
    assert all(reached(entry, up) for entry in found.values()), found
    assert len(up.seen) == len(tries)
    assert handle.violations == []


async def test_metadata_stays_refused_even_when_listed(lab: Lab) -> None:
    # The deny list wins over every allowlist entry, a literal one included.
    handle = lab.launch(egressAllowlist=["169.254.169.254", META_NAME])
    found, _ = await run_raw(
        handle,
        attempt("connect", "connect", "169.254.169.254", 80),
        attempt("socks", "socks-ipv4", "169.254.169.254", 80),
        attempt("mapped", "socks-domain", "::ffff:169.254.169.254", 80),
        attempt("name", "connect", META_NAME, 80),
    )
    assert all(refused(entry) for entry in found.values()), found
    mapped = ipaddress.ip_address("::ffff:169.254.169.254")
    assert_violations(handle, [(METADATA, 80), (METADATA, 80), (mapped, 80), (META_NAME, 80)])


@pytest.mark.parametrize("address", ["127.0.0.2", "93.184.216.34"])
async def test_connect_to_an_unlisted_ip_literal_is_refused(lab: Lab, address: str) -> None:
    up = lab.upstream
    handle = lab.launch(egressAllowlist=[ALLOWED, "127.0.0.1"])
    found, _ = await run_raw(
        handle,
        attempt("control", "connect", "127.0.0.1", up.port),
        attempt("connect", "connect", address, 443),
        attempt("socks", "socks-ipv4", address, 443),
    )
    assert reached(found.pop("control"), up), found  # a listed literal is reachable
    assert all(refused(entry) for entry in found.values()), found
    reason = f"X-Cc-Server-Egress-Reason: {address} is not on this session's egress allowlist"
    assert reason in found["connect"]["reply"], found
    result = await lab.sh(handle, f"{CURL} {VIA_HTTP_CONNECT} https://{address}/")
    text = output(result)
    assert result.exit_code == CURL_TUNNEL_FAILED and DENIED_HEADER.search(text), text
    literal = ipaddress.ip_address(address)
    assert_violations(handle, [(literal, 443)] * 3)
    assert up.seen == [f"127.0.0.1:{up.port}"]


@pytest.mark.parametrize(
    ("off", "suggested"),
    [
        ({"networkEnabled": False}, None),
        ({"capabilities": {"canUseNetwork": False}}, "canUseNetwork"),
    ],
    ids=["network-disabled", "no-network-capability"],
)
async def test_network_off_refuses_everything(
    lab: Lab, off: dict[str, Any], suggested: str | None
) -> None:
    up = lab.upstream
    allowlist = [ALLOWED, "127.0.0.1"]
    handle = lab.launch(egressAllowlist=allowlist, **off)
    result = await lab.sh(
        handle,
        f"""
        {CURL} -w '\\nforward=%{{http_code}}\\n' http://{ALLOWED}:{up.port}/; echo "forward=$?"
        {CURL} {VIA_HTTP_CONNECT} http://{ALLOWED}:{up.port}/; echo "connect=$?"
        {CURL} {VIA_SOCKS_NAME} http://{ALLOWED}:{up.port}/; echo "socks=$?"
        """,
    )
    text = output(result)
    codes = re.findall(r"(?m)^(\w+)=(\d+)$", text)
    # The proxies still answer (a 403, not a refused connection): the allowlist is empty.
    assert codes == [
        ("forward", "403"),
        ("forward", "0"),
        ("connect", str(CURL_TUNNEL_FAILED)),
        ("socks", str(CURL_PROXY_HANDSHAKE)),
    ], text
    assert len(DENIED_HEADER.findall(text)) == 2 and up.marker not in text, text
    found, _ = await run_raw(
        handle,
        attempt("connect", "connect", "127.0.0.1", up.port),
        attempt("socks", "socks-ipv4", "127.0.0.1", up.port),
    )
    assert all(refused(entry) for entry in found.values()), found
    assert up.seen == [] and lab.dns.asked == []  # refused before any lookup
    assert_violations(handle, [(ALLOWED, up.port)] * 3 + [(LOOPBACK, up.port)] * 2, suggested)
    # Control: the same allowlist with the network on reaches the upstream.
    control = await lab.sh(
        lab.launch(egressAllowlist=allowlist), f"{CURL} http://{ALLOWED}:{up.port}/"
    )
    assert control.exit_code == 0 and up.marker in output(control), output(control)


# --- the bridge sockets ----------------------------------------------------------------------


async def test_the_bridge_sockets_are_the_same_proxies(socat_lab: Lab) -> None:
    lab = socat_lab
    up = lab.upstream
    handle = lab.launch(egressAllowlist=[ALLOWED, "127.0.0.1"])
    found, result = await run_raw(
        handle,
        attempt("control http", "connect", ALLOWED, up.port, over="unix"),
        attempt("control socks", "socks-domain", ALLOWED, up.port, over="unix"),
        attempt("connect", "connect", DENIED, up.port, over="unix"),
        attempt("forward", "forward", DENIED, up.port, over="unix"),
        attempt("socks", "socks-domain", DENIED, up.port, over="unix"),
        attempt("socks metadata", "socks-ipv4", "169.254.169.254", 80, over="unix"),
        attempt("socks ipv6 loopback", "socks-ipv6", "::1", up.port6, over="unix"),
        attempt("connect decimal", "connect", "2852039166", 80, over="unix"),
    )
    # Control: connect(2) to the sockets works, and reaches the proxies.
    assert reached(found.pop("control http"), up) and reached(found.pop("control socks"), up)
    assert all(refused(entry) for entry in found.values()), found
    assert sorted(up.seen) == [f"{ALLOWED}:{up.port}"] * 2
    expected = [(DENIED, up.port)] * 3 + [
        (METADATA, 80),
        (ipaddress.ip_address("::1"), up.port6),
        (METADATA, 80),
    ]
    assert_violations(handle, expected)
    assert [split_target(v.target) for v in result.violations] == expected


async def test_the_bridge_directory_is_read_only(socat_lab: Lab) -> None:
    lab = socat_lab
    up = lab.upstream
    handle = lab.launch(egressAllowlist=[ALLOWED, "127.0.0.1"])
    first = await lab.sh(handle, f"{CURL} http://{ALLOWED}:{up.port}/")
    assert up.marker in output(first), output(first)
    egress = handle.egress
    proxies = getattr(egress, "proxies", None)
    assert proxies is not None and proxies.http_socket and proxies.socks_socket
    host_dir = os.path.dirname(proxies.http_socket)
    before = {path: os.lstat(path) for path in (proxies.http_socket, proxies.socks_socket)}
    bind = (
        f"{PY} -c 'import socket, sys; s = socket.socket(socket.AF_UNIX); "
        "s.bind(sys.argv[1]); s.listen(1)'"
    )
    http_sock, socks_sock = f"{BRIDGE_DIR}/http.sock", f"{BRIDGE_DIR}/socks.sock"
    result = await lab.sh(
        handle,
        attempts(
            control_sockets=f"test -S {http_sock} && test -S {socks_sock}",
            control_bind=f"{bind} /tmp/own.sock",
            create=f"touch {BRIDGE_DIR}/new",
            mkdir=f"mkdir {BRIDGE_DIR}/sub",
            remove=f"rm -f {http_sock}",
            rename=f"mv {socks_sock} {BRIDGE_DIR}/moved",
            replace=f"ln -sf /tmp/own.sock {http_sock}",
            chmod=f"chmod 0777 {http_sock}",
            bind_new=f"{bind} {BRIDGE_DIR}/evil.sock",
            bind_over=f"rm -f {http_sock}; {bind} {http_sock}",
            host_dir=f"ls {host_dir}",
        )
        + f"\n{CURL} http://{ALLOWED}:{up.port}/",
    )
    verdicts = outcomes(result)
    assert verdicts.pop("control_sockets") == "ok" and verdicts.pop("control_bind") == "ok"
    assert verdicts == dict.fromkeys(verdicts, "fail") and len(verdicts) == 9, verdicts
    # The proxies still answer through the same sockets afterwards.
    assert output(result).count(up.marker) == 1, output(result)
    for path, info in before.items():
        now = os.lstat(path)
        assert (now.st_ino, now.st_mode) == (info.st_ino, info.st_mode), path
    assert handle.violations == []


async def test_a_command_cannot_take_over_the_proxy_ports(lab: Lab) -> None:
    """The proxies' loopback ports are taken before the command runs, so it cannot listen there
    itself (plain, with SO_REUSEADDR or SO_REUSEPORT, on 0.0.0.0 either) to see another
    command's proxy traffic, and its proxied request still reaches the real proxy."""
    up = lab.upstream
    handle = lab.launch(egressAllowlist=[ALLOWED, "127.0.0.1"])

    def bind(host: str, port: int, option: str = "") -> str:
        opt = f"s.setsockopt(socket.SOL_SOCKET, socket.{option}, 1); " if option else ""
        return (
            f"{PY} -c 'import socket; s = socket.socket(); {opt}"
            f"s.bind((\"{host}\", {port})); s.listen(1)'"
        )

    tries = {
        f"{kind}_{name}": bind(host, port, option)
        for kind, port in (("http", HTTP_PROXY_PORT), ("socks", SOCKS_PROXY_PORT))
        for name, host, option in (
            ("plain", "127.0.0.1", ""),
            ("reuseaddr", "127.0.0.1", "SO_REUSEADDR"),
            ("reuseport", "127.0.0.1", "SO_REUSEPORT"),
            ("any", "0.0.0.0", "SO_REUSEADDR"),
        )
    }
    result = await lab.sh(
        handle,
        attempts(control=bind("127.0.0.1", 8080), **tries)
        + f"\n{CURL} http://{ALLOWED}:{up.port}/",
    )
    verdicts = outcomes(result)
    assert verdicts.pop("control") == "ok", output(result)
    assert verdicts == dict.fromkeys(tries, "fail"), verdicts
    assert up.marker in output(result), output(result)


# --- capabilities ----------------------------------------------------------------------------


async def test_a_github_refusal_suggests_the_capability(lab: Lab) -> None:
    handle = lab.launch()  # the default capabilities: no GitHub
    found, _ = await run_raw(
        handle,
        attempt("connect", "connect", "github.com", 443),
        attempt("socks", "socks-domain", "api.github.com", 443),
    )
    assert all(refused(entry) for entry in found.values()), found
    assert "canCallGitHubApi" in found["connect"]["reply"], found  # the 403 says how to ask
    result = await lab.sh(handle, f"{CURL} {VIA_HTTP_CONNECT} https://codeload.github.com/")
    assert result.exit_code == CURL_TUNNEL_FAILED, output(result)
    assert_violations(
        handle,
        [("github.com", 443), ("api.github.com", 443), ("codeload.github.com", 443)],
        suggested="canCallGitHubApi",
    )
    assert lab.dns.asked == []  # refused at the allowlist, before any lookup
    # Control: with the capability the allowlist lets github.com through to the resolver (which
    # knows no address for it here: a 502, and no violation).
    earned = lab.launch(capabilities={"canCallGitHubApi": True})
    found, _ = await run_raw(earned, attempt("connect", "connect", "github.com", 443))
    reply = found["connect"]["reply"]
    assert reply.startswith("HTTP/1.1 502 ") and "upstream-failed" in reply, found
    assert earned.violations == [] and lab.dns.asked == ["github.com"]


# --- teardown --------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["running", "finished"])
async def test_aclose_leaves_no_proxy_socket_or_bridge(lab: Lab, command: str) -> None:
    up = lab.upstream
    handoff = CREATE_LAUNCHER_TOOL in lab.sb.manager.probe_result.tools
    handle = lab.launch(egressAllowlist=[ALLOWED, "127.0.0.1"])
    first = await lab.sh(handle, f"{CURL} http://{ALLOWED}:{up.port}/")
    assert up.marker in output(first), output(first)
    proxies = getattr(handle.egress, "proxies", None)
    assert proxies is not None and proxies.http_socket
    session_dir = os.path.dirname(proxies.http_socket)
    # Control: the private directory and the proxies exist while the session lives.
    info = os.lstat(session_dir)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    assert stat.S_IMODE(os.lstat(proxies.http_socket).st_mode) == 0o600
    assert os.path.dirname(session_dir) == egress_base_dir()
    # No loopback TCP listener another local user could reach: the sockets are the only door.
    assert proxies.http_port is None and proxies.socks_port is None
    assert sorted(os.listdir(session_dir)) == ["http.sock", "socks.sock"]
    netns_file = lab.sb.worktree / "netns"
    script = f"readlink /proc/self/ns/net > {netns_file}"
    if command == "running":
        script += "; exec sleep 300"
    async with asyncio.timeout(RUN_TIMEOUT_S), handle.open_exec(["/bin/sh", "-c", script]) as ex:
        assert await wait_until(lambda: netns_file.exists() and netns_file.read_text() != "")
        netns = netns_file.read_text().strip()
        listeners = proxy_listeners(netns) if command == "running" else {}
        if command == "running" and handoff:
            # Control: the sandbox's two loopback listeners are held by the server alone (the
            # launcher made them and handed them over); no socat runs.
            held = listeners
            assert sorted(map(sorted, held.values())) == [[os.getpid()]] * 2, held
            assert bridge_pids(netns) == []
        elif command == "running":
            # Control: the host sees the sandbox's two socat listeners.
            assert await wait_until(lambda: len(bridge_pids(netns)) == 2), bridge_pids(netns)
        else:
            assert await ex.wait() == 0
            # Between commands nothing listens: the bridge ends with the sandbox's PID namespace.
            assert await wait_until(lambda: not bridge_pids(netns)), bridge_pids(netns)
        await lab.sb.manager.aclose()
        assert handle.state is SandboxState.DESTROYED
        if command == "running":
            assert await ex.wait() != 0  # destroy killed it
    assert not os.path.lexists(session_dir)
    assert await wait_until(lambda: not netns_pids(netns)), netns_pids(netns)
    assert host_pids_with(session_dir) == []  # no bwrap still holds the directory's bind
    if handoff:  # the server closed the sandbox's listeners with it
        assert not set(listeners) & set(proxy_listeners_held_by(os.getpid(), listeners))


async def test_a_new_manager_removes_what_a_killed_server_left(
    sb: Sandboxes, probe_result: ProbeResult
) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(STALE_PID, 0)
    base = egress_base_dir()
    stale = os.path.join(base, f"egress-{STALE_PID}-0123456789abcdef")
    live = os.path.join(base, f"egress-{os.getpid()}-{secrets.token_hex(8)}")
    foreign = os.path.join(base, f"egress-{STALE_PID}-{secrets.token_hex(4)}-not-ours")
    try:
        for directory in (stale, live, foreign):
            os.mkdir(directory, 0o700)
            with open(os.path.join(directory, "http.sock"), "w"):
                pass
        manager = SandboxManager(probe_result=probe_result, host=sb.manager.host)
        try:
            handle = manager.launch(parse_spec(sb.spec()))
            # Removed by the first native launch of a new manager, before any command runs.
            assert not os.path.lexists(stale)
            assert os.path.isdir(live)  # its server (this process) is alive
            assert os.path.isdir(foreign)  # not a name the runtime creates
            result = await sb.sh(handle, "echo control")  # the new manager's egress works
            assert "control" in output(result)
        finally:
            await manager.aclose()
    finally:
        for directory in (stale, live, foreign):
            shutil.rmtree(directory, ignore_errors=True)


async def test_binding_the_socket_base_does_not_reach_another_sessions_proxies(lab: Lab) -> None:
    up = lab.upstream
    other = lab.launch(egressAllowlist=[ALLOWED, "127.0.0.1"])
    first = await lab.sh(other, f"{CURL} http://{ALLOWED}:{up.port}/")  # starts its proxies
    assert up.marker in output(first), output(first)
    proxies = getattr(other.egress, "proxies", None)
    assert proxies is not None and proxies.http_socket
    base = egress_base_dir()
    parent = os.path.dirname(base)
    planted = f"planted-{secrets.token_hex(4)}"
    # The attacker binds the directory above every session's sockets (e.g. /tmp), writable.
    attacker = lab.launch(
        bindMounts=[{"hostPath": str(lab.sb.worktree)}, {"hostPath": parent}],
        egressAllowlist=[],
    )
    script = f"""ls -A {base} | wc -l
{PY} - <<'EOF2'
import socket
s = socket.socket(socket.AF_UNIX)
try:
    s.connect({proxies.http_socket!r})
    s.sendall(b"CONNECT {ALLOWED}:{up.port} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    print("reached", s.recv(100))
except OSError as exc:
    print("refused", exc.errno)
EOF2
touch {base}/{planted}; echo touch=$?"""
    result = await lab.sh(attacker, script)
    text = output(result)
    assert text.splitlines()[0].strip() == "0", text  # the base is an empty mask inside
    assert "refused" in text and "reached" not in text, text
    assert "touch=1" in text and not os.path.exists(os.path.join(base, planted)), text
    # Control: the other session's own sandbox still reaches its proxies.
    again = await lab.sh(other, f"{CURL} http://{ALLOWED}:{up.port}/")
    assert up.marker in output(again), output(again)


async def test_another_sessions_proxy_socket_refuses_a_foreign_sandbox(lab: Lab) -> None:
    """Even bound in on purpose (the spec binds the other session's socket directory), the
    socket serves only its own session's sandboxes: the foreign sandbox's peer is closed unread."""
    up = lab.upstream
    other = lab.launch(egressAllowlist=[ALLOWED, "127.0.0.1"])
    first = await lab.sh(other, f"{CURL} http://{ALLOWED}:{up.port}/")  # starts its proxies
    assert up.marker in output(first), output(first)
    proxies = getattr(other.egress, "proxies", None)
    assert proxies is not None and proxies.http_socket
    attacker = lab.launch(
        bindMounts=[
            {"hostPath": str(lab.sb.worktree)},
            {"hostPath": os.path.dirname(proxies.http_socket), "readOnly": True},
        ],
        egressAllowlist=[ALLOWED, "127.0.0.1"],
    )
    script = f"""{PY} - <<'EOF2'
import os, socket
print("visible", os.path.exists({proxies.http_socket!r}))
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
try:
    s.connect({proxies.http_socket!r})
    s.sendall(b"CONNECT {ALLOWED}:{up.port} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    print("reply", s.recv(100))
except OSError as exc:
    print("refused", exc.errno)
EOF2"""
    text = output(await lab.sh(attacker, script))
    assert "visible True" in text, text  # the bind itself is honoured
    assert "HTTP/1.1 200" not in text and ("reply b''" in text or "refused" in text), text
    again = await lab.sh(other, f"{CURL} http://{ALLOWED}:{up.port}/")  # control
    assert up.marker in output(again), output(again)
