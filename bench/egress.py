#!/usr/bin/env python3
"""Egress proxy throughput and request overhead, each as a ratio to a direct connection measured
in the same run.

Cases (one warm-up round is thrown away, then --runs rounds; each round runs every case once and
starts one case further along than the round before; each figure is the median over the rounds):
  download direct    a --size-mib download of random bytes straight from the upstream
  download CONNECT   the same through a CONNECT tunnel of the session's HTTP proxy (curl -p -x)
  download SOCKS5    the same through the session's SOCKS5 proxy (curl --socks5)
  small direct       500 sequential GETs of a 1 KiB body, a new connection each
  small via proxy    the same through the HTTP proxy (absolute-form GET, one request a connection)
  keep-alive direct  500 sequential GETs of 1 KiB on one kept-alive connection
  keep-alive proxy   the same asked of the HTTP proxy (absolute-form): one client connection,
                     each request checked on its own, the upstream connection reused
  keep-alive CONNECT the same inside one CONNECT tunnel (one check, then the relay only)
  --costs            instead of the cases: where a forwarded request's time goes, counted rather
                     than timed (steadier on a loaded machine): the proxies' thread's user and
                     system CPU, its event-loop iterations and (with strace installed, attached to
                     that thread) its system calls by name, each per request, over --runs x 500
                     requests with a new connection each, and as many kept alive
  --soak             afterwards, 100 back-to-back downloads through the CONNECT tunnel, each hashed
                     (sha256) as it arrives and compared with the hash of the served file;
                     alternately Content-Length-framed and EOF-delimited (the end of the body is
                     the upstream's FIN, so a relay that lost its last bytes would show)

The upstream is a small threaded HTTP server in a child process on 127.0.0.1 that serves the
payload from a temporary file in the page cache with socket.sendfile (the relay spike's server,
shared/notes/proxy-relay-spike.md). It sends with the host's default congestion control, as any
server on this host would; --upstream-cc NAME makes it use another one, for the direct and the
proxied downloads alike. Where the default paces its sends (BBR), the pacing, not the CPU, bounds
the direct download on loopback and makes it swing from run to run (with --upstream-cc reno the
direct download runs much faster). The relay tunes its own loopback leg (Reno, which does not pace,
and a small TCP_NOTSENT_LOWAT: see egress/relay.py); the upstream's leg is paced in the proxied
downloads as in the direct ones. The client is curl, one process per download (-w
'%{speed_download}', output discarded, size and status checked) and one process per 500 small
requests (a config file of 500 URLs, `Connection: close`, every response checked). The session's
proxies (open_session_proxies) run in this process on an asyncio loop in a thread of their own; the
upstream and the clients are other processes and the main thread only waits for them (or, in the
soak, reads and hashes with the GIL released), so nothing starves the loop.

Besides the medians it prints, per download case, the ratio to direct within each round and the
CPU time of the proxies' thread per GiB moved, and per request for the small cases, which is
steadier than the wall time on a loaded machine (the proxies' own cost; the kernel's work on the
far side of each loopback hop is charged to whichever process sends into it).
Targets: CONNECT and SOCKS5 download >= 0.75x direct (issue 17 asks 0.85x); soak: every transfer
byte-for-byte; the proxy's own cost per request <= +0.3 ms with a new connection each and
<= +0.15 ms kept alive (issue 17; measured and printed: see docs/egress.md).

Usage: .venv/bin/python bench/egress.py [--runs N] [--size-mib 200] [--soak] [--upstream-cc NAME]
       .venv/bin/python bench/egress.py --costs [--runs N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from cc_server.egress.driver import EgressRefused, ProxyParams, open_session_proxies
from cc_server.egress.patterns import Allowlist, AllowlistRule, parse_pattern

MIB = 1024 * 1024
SMALL_BYTES = 1024
SMALL_REQUESTS = 500
SOAK_TRANSFERS = 100
TARGET_RATIO = 0.75
# Generous bounds, so a hung transfer fails the run instead of hanging it.
CURL_TIMEOUT_S = 600
STARTUP_TIMEOUT_S = 30
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)
DEFAULT_CC_PATH = "/proc/sys/net/ipv4/tcp_congestion_control"


# The upstream: a child process, so its threads never compete with the proxy loop for the GIL.


def _serve(path: str, congestion: str, ready: Connection) -> None:
    """Serve GET /big (the payload file; `?nolen`: no Content-Length, the body ends at EOF) and
    GET /small (1 KiB); one thread per connection, one request per connection. `congestion`: the
    congestion control to send with ("" for the host's default)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    small = os.urandom(SMALL_BYTES)
    size = os.path.getsize(path)
    server = socket.create_server(("127.0.0.1", 0), backlog=128)
    if congestion:  # accepted connections inherit it
        server.setsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, congestion.encode())
    ready.send(server.getsockname()[1])
    ready.close()
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_handle, args=(conn, path, size, small), daemon=True).start()


def _handle(conn: socket.socket, path: str, size: int, small: bytes) -> None:
    with conn, contextlib.suppress(OSError):
        conn.settimeout(30)
        buffered = b""
        while True:  # requests for /small on a connection that asks to be kept alive
            while b"\r\n\r\n" not in buffered and len(buffered) < 65536:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                buffered += chunk
            head, _, buffered = buffered.partition(b"\r\n\r\n")
            parts = head.split(b" ", 2)
            target = parts[1] if len(parts) == 3 else b""
            keep = target == b"/small" and b"\r\nconnection: close" not in head.lower()
            if not keep:
                break
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(small), small)
            )
        if target == b"/small":
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(small), small)
            )
        elif target in (b"/big", b"/big?nolen"):
            length = b"" if target.endswith(b"?nolen") else b"Content-Length: %d\r\n" % size
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n%s"
                b"Connection: close\r\n\r\n" % length
            )
            conn.settimeout(None)  # blocking: one sendfile call moves the whole file
            with open(path, "rb") as payload:
                conn.sendfile(payload)
            conn.settimeout(30)
        else:
            conn.sendall(
                b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
        # Half-close, then wait for the client's EOF: the last bytes are never reset away.
        conn.shutdown(socket.SHUT_WR)
        while conn.recv(65536):
            pass


@contextlib.contextmanager
def upstream(path: str, congestion: str = "") -> Iterator[int]:
    """The upstream server for the duration of the block; yields its port on 127.0.0.1."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_serve, args=(path, congestion, send),
                          name="egress-bench-upstream")
    process.start()
    send.close()
    try:
        if not receive.poll(STARTUP_TIMEOUT_S):
            raise RuntimeError("the upstream server did not start")
        port: int = receive.recv()
        receive.close()
        yield port
    finally:
        process.terminate()
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()


# The session's proxies: their own event loop in a background thread.


@dataclass
class Proxies:
    http_port: int = 0
    socks_port: int = 0
    thread_id: int = 0
    """The native id of the thread the proxies run on."""
    refusals: list[EgressRefused] = field(default_factory=list)


@contextlib.contextmanager
def session_proxies() -> Iterator[Proxies]:
    """One session's proxies, allowing exactly the literal 127.0.0.1, on a loop in a thread."""
    allowlist = Allowlist(
        patterns=(AllowlistRule(parse_pattern("127.0.0.1"), "the benchmark's upstream"),)
    )
    found = Proxies()
    ready = threading.Event()
    failure: list[BaseException] = []
    stop: list[Callable[[], None]] = []

    async def run() -> None:
        stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        stop.append(lambda: loop.call_soon_threadsafe(stopped.set))
        params = ProxyParams(
            session_id="bench", allowlist=allowlist, on_refused=found.refusals.append
        )
        async with open_session_proxies(params) as proxies:
            found.http_port, found.socks_port = proxies.http_port, proxies.socks_port
            ready.set()
            await stopped.wait()

    def main() -> None:
        found.thread_id = threading.get_native_id()
        try:
            asyncio.run(run())
        except BaseException as exc:
            failure.append(exc)
        finally:
            ready.set()

    thread = threading.Thread(target=main, name="egress-bench-proxies", daemon=True)
    thread.start()
    try:
        if not ready.wait(STARTUP_TIMEOUT_S) or failure or not stop:
            raise RuntimeError("the session proxies did not start") from (
                failure[0] if failure else None
            )
        yield found
    finally:
        if stop:
            stop[0]()
        thread.join(STARTUP_TIMEOUT_S)
    if failure:
        raise RuntimeError("the session proxies failed") from failure[0]


def thread_cpu_s(thread_id: int) -> float:
    """User plus system CPU seconds of a thread of this process (procfs)."""
    return sum(thread_cpu_split_s(thread_id))


def default_congestion_control() -> str:
    try:
        with open(DEFAULT_CC_PATH) as cc:
            return cc.read().strip()
    except OSError:
        return "unknown"


# The clients.


def download(url: str, proxy: list[str], size: int) -> float:
    """One download with curl, output discarded; returns bytes/s (curl's speed_download)."""
    cmd = ["curl", "-s", "-S", "-f", "-o", "/dev/null",
           "-w", "%{speed_download} %{size_download}", *proxy, url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=CURL_TIMEOUT_S)
    fields = done.stdout.split()
    if done.returncode != 0 or len(fields) != 2 or int(fields[1]) != size:
        raise RuntimeError(
            f"download failed: {' '.join(cmd)}: exit {done.returncode}, "
            f"out {done.stdout!r}, err {done.stderr.strip()!r}"
        )
    return float(fields[0])


def small_requests(config: str, proxy: list[str], *, keep_alive: bool = False,
                   reconnects: bool = True) -> float:
    """SMALL_REQUESTS sequential requests in one curl process; returns the wall time in s.
    `keep_alive`: curl may reuse its connection; `reconnects`: each request still needs a new
    one (the HTTP proxy closes after each forwarded request), else only the first does."""
    close = [] if keep_alive else ["-H", "Connection: close"]
    cmd = ["curl", "-s", "-S", "-K", config, *close,
           "-w", "%{http_code} %{size_download} %{num_connects}\n", *proxy]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=CURL_TIMEOUT_S)
    elapsed = time.perf_counter() - start
    lines = done.stdout.splitlines()
    # status, body size, new connections for this request: one each, or one for the first only
    expected = {f"200 {SMALL_BYTES} 1"} if reconnects else {f"200 {SMALL_BYTES} 1",
                                                            f"200 {SMALL_BYTES} 0"}
    if done.returncode != 0 or len(lines) != SMALL_REQUESTS or not set(lines) <= expected or (
        not reconnects and lines.count(f"200 {SMALL_BYTES} 1") != 1
    ):
        raise RuntimeError(
            f"small requests failed: {' '.join(cmd)}: exit {done.returncode}, "
            f"{len(lines)} results, unexpected {sorted(set(lines) - expected)[:3]}, "
            f"err {done.stderr.strip()[:200]!r}"
        )
    return elapsed


def hashed_download(url: str, proxy: list[str]) -> tuple[int, str, int, str]:
    """One download with curl into a pipe, hashed as it arrives.

    Returns (bytes, sha256 hex, curl's exit status, curl's stderr)."""
    digest = hashlib.sha256()
    buffer = bytearray(MIB)
    view = memoryview(buffer)
    total = 0
    with subprocess.Popen(["curl", "-s", "-S", "-f", *proxy, url], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, bufsize=0) as curl:
        assert curl.stdout is not None and curl.stderr is not None
        with contextlib.suppress(OSError):
            fcntl.fcntl(curl.stdout.fileno(), F_SETPIPE_SZ, MIB)
        while n := curl.stdout.readinto(view):  # type: ignore[attr-defined]
            digest.update(view[:n])
            total += n
        err = curl.stderr.read().decode(errors="replace").strip()
        status = curl.wait(CURL_TIMEOUT_S)
    return total, digest.hexdigest(), status, err


# The run.


def make_payload(path: str, size: int) -> str:
    """Write `size` random bytes to `path`; return their sha256 hex."""
    digest = hashlib.sha256()
    with open(path, "wb") as out:
        left = size
        while left:
            chunk = os.urandom(min(left, 8 * MIB))
            digest.update(chunk)
            out.write(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def mb(rate: float) -> str:
    return f"{rate / 1e6:.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument("--size-mib", type=int, default=200, help="download size (default 200)")
    parser.add_argument("--soak", action="store_true",
                        help=f"then {SOAK_TRANSFERS} verified downloads through the tunnel")
    parser.add_argument("--costs", action="store_true",
                        help="count a forwarded request's CPU, loop iterations and system calls")
    parser.add_argument("--upstream-cc", default="", metavar="NAME",
                        help="congestion control the upstream sends with (default: the host's, "
                        f"{default_congestion_control()})")
    args = parser.parse_args()
    if args.runs < 1 or args.size_mib < 1:
        parser.error("--runs and --size-mib must be at least 1")
    if shutil.which("curl") is None:
        print("curl is not installed (scripts/bootstrap installs it)", file=sys.stderr)
        return 1
    if args.costs:
        return run_costs(args.runs)
    size = args.size_mib * MIB
    work = tempfile.mkdtemp(prefix="cc-bench-egress-")
    try:
        payload = os.path.join(work, "payload")
        served_sha = make_payload(payload, size)
        with upstream(payload, args.upstream_cc) as port, session_proxies() as proxies:
            big = f"http://127.0.0.1:{port}/big"
            config = os.path.join(work, "small.curl")
            with open(config, "w") as out:
                out.write(f'url = "http://127.0.0.1:{port}/small"\noutput = "/dev/null"\n'
                          * SMALL_REQUESTS)
            connect = ["-p", "-x", f"http://127.0.0.1:{proxies.http_port}"]
            socks = ["--socks5", f"127.0.0.1:{proxies.socks_port}"]
            forward = ["-x", f"http://127.0.0.1:{proxies.http_port}"]
            cases: list[tuple[str, Callable[[], float]]] = [
                ("download direct", lambda: download(big, [], size)),
                ("download CONNECT", lambda: download(big, connect, size)),
                ("download SOCKS5", lambda: download(big, socks, size)),
                ("small direct", lambda: small_requests(config, [])),
                ("small via proxy", lambda: small_requests(config, forward)),
                ("keep-alive direct",
                 lambda: small_requests(config, [], keep_alive=True, reconnects=False)),
                ("keep-alive proxy",
                 lambda: small_requests(config, forward, keep_alive=True, reconnects=False)),
                ("keep-alive CONNECT",
                 lambda: small_requests(config, connect, keep_alive=True, reconnects=False)),
            ]
            samples: dict[str, list[float]] = {name: [] for name, _ in cases}
            proxy_cpu_s: dict[str, float] = {name: 0.0 for name, _ in cases}
            for round_ in range(args.runs + 1):  # round 0 is the warm-up
                start = round_ % len(cases)
                for name, run in cases[start:] + cases[:start]:
                    cpu_before = thread_cpu_s(proxies.thread_id)
                    value = run()
                    if round_:
                        samples[name].append(value)
                        proxy_cpu_s[name] += thread_cpu_s(proxies.thread_id) - cpu_before
            soak = run_soak(f"{big}?nolen", big, connect, size, served_sha) if args.soak else None
            refusals = list(proxies.refusals)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {name: statistics.median(values) for name, values in samples.items()}
    print(f"egress bench: {args.size_mib} MiB download, {SMALL_REQUESTS} x {SMALL_BYTES} B "
          f"requests; median of {args.runs} run(s) after one warm-up round, order rotated per "
          "round")
    print("client: curl (one process per download, one per 500 requests); upstream: threaded "
          "sendfile server (child process) sending with "
          f"{args.upstream_cc or default_congestion_control() + ' (the host default)'}; "
          "proxies: in-process asyncio loop (own thread)")
    print(f"{'case':<18}{'median':>14}{'min..max':>20}{'x direct':>10}  "
          "x direct per round; proxy thread CPU")
    gib = args.runs * size / 2**30
    for name in ("download direct", "download CONNECT", "download SOCKS5"):
        lo, hi = min(samples[name]), max(samples[name])
        paired = [x / d for x, d in zip(samples[name], samples["download direct"], strict=True)]
        detail = "" if name == "download direct" else (
            f"  {' '.join(f'{r:.2f}' for r in paired)} (median {statistics.median(paired):.2f}); "
            f"{proxy_cpu_s[name] / gib:.2f} CPU-s/GiB")
        print(f"{name:<18}{mb(med[name]) + ' MB/s':>14}{mb(lo) + '..' + mb(hi) + ' MB/s':>20}"
              f"{med[name] / med['download direct']:>10.2f}{detail}")
    for name, base in (("small direct", "small direct"), ("small via proxy", "small direct"),
                       ("keep-alive direct", "keep-alive direct"),
                       ("keep-alive proxy", "keep-alive direct"),
                       ("keep-alive CONNECT", "keep-alive direct")):
        lo, hi = min(samples[name]), max(samples[name])
        added = (med[name] - med[base]) / SMALL_REQUESTS * 1000
        cpu_us = proxy_cpu_s[name] / (args.runs * SMALL_REQUESTS) * 1e6
        print(f"{name:<18}{med[name] * 1000:>11.0f} ms{f'{lo * 1000:.0f}..{hi * 1000:.0f} ms':>20}"
              f"{med[name] / med[base]:>10.2f}"
              f"   ({med[name] / SMALL_REQUESTS * 1000:.2f} ms/request"
              + ("" if name == base else f", {added:+.2f} ms over {base}")
              + ("" if name == base else f"; proxy thread {cpu_us:.0f} CPU-us/request") + ")")
    tunnel = med["download CONNECT"] / med["download direct"]
    socks5 = med["download SOCKS5"] / med["download direct"]
    print(f"targets: CONNECT tunnel {tunnel:.2f}x direct (target >= {TARGET_RATIO}: "
          f"{'met' if tunnel >= TARGET_RATIO else 'MISSED'}); SOCKS5 {socks5:.2f}x direct "
          f"(target >= {TARGET_RATIO}: {'met' if socks5 >= TARGET_RATIO else 'MISSED'}); "
          f"small requests via proxy take {med['small via proxy'] / med['small direct']:.2f}x "
          "the direct time; per request the proxy adds "
          f"{(med['small via proxy'] - med['small direct']) / SMALL_REQUESTS * 1000:+.2f} ms "
          "(new connection each, target <= +0.30), "
          f"{(med['keep-alive proxy'] - med['keep-alive direct']) / SMALL_REQUESTS * 1000:+.2f} "
          "ms (keep-alive asked of the HTTP proxy, target <= +0.15), "
          f"{(med['keep-alive CONNECT'] - med['keep-alive direct']) / SMALL_REQUESTS * 1000:+.2f}"
          " ms (keep-alive inside a CONNECT tunnel)")
    if refusals:
        print(f"unexpected refusals: {len(refusals)}, first: {refusals[0].raw}")
    if soak is None:
        return 0
    ok, failures, elapsed, rates = soak
    print(f"soak: {SOAK_TRANSFERS} x {args.size_mib} MiB back to back through the CONNECT tunnel "
          "(alternately EOF-delimited and Content-Length), each sha256 compared with the served "
          f"file's: {ok} ok, {len(failures)} failed, total {elapsed:.1f} s "
          f"(median {mb(statistics.median(rates))} MB/s a transfer, hashing included); "
          f"target {SOAK_TRANSFERS}/{SOAK_TRANSFERS}: "
          f"{'met' if not failures else 'MISSED'}")
    for failure in failures[:5]:
        print(f"  failed: {failure}")
    return 1 if failures else 0


def thread_cpu_split_s(thread_id: int) -> tuple[float, float]:
    """User and system CPU seconds of a thread of this process (procfs)."""
    with open(f"/proc/self/task/{thread_id}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def run_costs(runs: int) -> int:
    """--costs: per forwarded request, the proxies' thread's CPU, loop iterations, system calls."""
    iterations = [0]
    loop_class = asyncio.SelectorEventLoop
    run_once = loop_class._run_once  # type: ignore[attr-defined]

    def counted(self: asyncio.AbstractEventLoop) -> None:
        iterations[0] += 1
        run_once(self)

    loop_class._run_once = counted  # type: ignore[attr-defined]
    work = tempfile.mkdtemp(prefix="cc-bench-egress-")
    requests = runs * SMALL_REQUESTS
    results: list[tuple[str, float, float, float, dict[str, float] | None]] = []
    try:
        payload = os.path.join(work, "payload")
        make_payload(payload, MIB)
        with upstream(payload) as port, session_proxies() as proxies:
            config = os.path.join(work, "small.curl")
            with open(config, "w") as out:
                out.write(f'url = "http://127.0.0.1:{port}/small"\noutput = "/dev/null"\n'
                          * SMALL_REQUESTS)
            forward = ["-x", f"http://127.0.0.1:{proxies.http_port}"]
            cases = (("a new connection each", {}),
                     ("kept alive", {"keep_alive": True, "reconnects": False}))
            for name, how in cases:
                small_requests(config, forward, **how)  # warm-up
                user, system = thread_cpu_split_s(proxies.thread_id)
                before = iterations[0]
                for _ in range(runs):
                    small_requests(config, forward, **how)
                user_after, system_after = thread_cpu_split_s(proxies.thread_id)
                loops = (iterations[0] - before) / requests
                calls = syscalls_per_request(config, forward, proxies.thread_id, work, how)
                results.append((name, user_after - user, system_after - system, loops, calls))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name, user_s, system_s, loops, calls in results:
        print(f"egress costs: {requests} forwarded requests of {SMALL_BYTES} B, {name}; per "
              "request, the proxies' thread:")
        print(f"  CPU {user_s / requests * 1e6:.0f} us user, {system_s / requests * 1e6:.0f} us "
              f"system; {loops:.2f} event-loop iterations")
        if calls is None:
            print("  system calls: strace is not installed (or cannot attach)")
        else:
            total = sum(calls.values())
            print(f"  system calls {total:.1f}: " + ", ".join(
                f"{call} {count:.2f}"
                for call, count in sorted(calls.items(), key=lambda c: -c[1])))
    return 0


def syscalls_per_request(
    config: str, forward: list[str], thread_id: int, work: str, how: dict[str, bool]
) -> dict[str, float] | None:
    """System calls by name per request of one more batch, from strace -c on the thread."""
    if shutil.which("strace") is None:
        return None
    out = os.path.join(work, "strace.txt")
    tracer = subprocess.Popen(["strace", "-c", "-o", out, "-p", str(thread_id)],
                              stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached (strace -p gives no signal of it)
    try:
        small_requests(config, forward, **how)
        time.sleep(0.2)
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(STARTUP_TIMEOUT_S)
    calls: dict[str, float] = {}
    with contextlib.suppress(OSError), open(out) as table:
        for line in table.read().splitlines()[2:]:
            fields = line.split()
            # % time, seconds, usecs/call, calls, [errors,] syscall
            if len(fields) in (5, 6) and fields[-1] != "total" and fields[3].isdigit():
                calls[fields[-1]] = int(fields[3]) / SMALL_REQUESTS
    return calls or None


def run_soak(
    nolen: str, framed: str, connect: list[str], size: int, served_sha: str
) -> tuple[int, list[str], float, list[float]]:
    """SOAK_TRANSFERS verified downloads: (ok count, failure descriptions, seconds, rates)."""
    ok = 0
    failures: list[str] = []
    rates: list[float] = []
    start = time.perf_counter()
    for i in range(SOAK_TRANSFERS):
        url = nolen if i % 2 == 0 else framed
        began = time.perf_counter()
        got, sha, status, err = hashed_download(url, connect)
        rates.append(got / (time.perf_counter() - began))
        if status == 0 and got == size and sha == served_sha:
            ok += 1
        else:
            failures.append(f"#{i} {url}: curl exit {status}, {got} of {size} bytes, "
                            f"sha256 {'matches' if sha == served_sha else 'differs'} {err!r}")
    return ok, failures, time.perf_counter() - start, rates


if __name__ == "__main__":
    sys.exit(main())
