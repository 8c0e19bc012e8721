#!/usr/bin/env python3
"""The server under load, measured against raw bwrap launches in the same run.

Starts a real `cc-server serve`, creates SANDBOXES native sandboxes over the HTTP API and runs
COMMANDS short commands (`/bin/true`) in each, all sandboxes concurrently (each sandbox's commands
one after another), every command through the sandbox's session stream (one WebSocket per sandbox,
opened before the load; --via ws: an exec WebSocket per command, --via post: POST .../exec). The
same shape of load is also run as raw bwrap launches (the namespaces cc-server uses, around
/bin/true, no server, no egress bridge) and through the library in this process (the same native
plan with its egress bridge, no HTTP). Prints, for each: commands/s and the p50/p99 latency from
the request to the `exit` event, and the server's numbers as a ratio to raw bwrap (and to the
library, which separates the server's own cost from the sandbox's).

Afterwards every sandbox is destroyed and the client disconnected, and the server's open file
descriptors and child processes must be back at their idle count (measured after one warm-up
create/exec/destroy cycle); the bench exits 1 if they are not.

Before the load, `/healthz` is timed while one `POST .../exec` sends --big-exec-bytes (1 GiB) of
stdout: a thread of this process asks `/healthz` every 10 ms over its own connection, idle and
then during the exec, and the p50/p99/max of each are printed with the server's peak RSS (VmHWM)
and the result's truncation fields. The result is kept bounded (16 MiB a stream) and encoded off
the server's event loop, so other clients should not wait for it.

Usage: .venv/bin/python bench/server.py [--sandboxes 50] [--commands 20]
                                        [--via session|ws|post]
                                        [--big-exec-bytes N] [--big-exec-only]
                                        [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable

import aiohttp

BOOT_TIMEOUT_S = 30.0
SETTLE_S = 10.0  # how long fds and children may take to return to idle after the load
HEALTHZ_EVERY_S = 0.01  # between two /healthz probes of the latency thread
IDLE_PROBES = 200  # /healthz probes before the big exec starts
BIG_EXEC_TIMEOUT_S = 600.0  # hang guard for the big exec
# --profile: the server's module run under cProfile timed by the process's CPU clock, so time
# spent waiting (or preempted by the sandboxes it wakes, on a loaded machine) is not counted.
CPU_PROFILED = """if True:
    import cProfile, runpy, sys, time
    out, module = sys.argv[1], sys.argv[2]
    sys.argv = sys.argv[2:]
    profiler = cProfile.Profile(time.process_time)
    try:
        profiler.runcall(runpy.run_module, module, run_name="__main__", alter_sys=True)
    finally:
        profiler.dump_stats(out)
"""


def start_server(work: str, runtime: str, profile: str | None = None
                 ) -> tuple[subprocess.Popen[bytes], str, int, str]:
    log_path = os.path.join(work, "server.log")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.path.join(work, "home"),
           "XDG_RUNTIME_DIR": runtime, "LANG": "C.UTF-8"}
    os.makedirs(env["HOME"], exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, *(["-c", CPU_PROFILED, profile] if profile else ["-m"]),
             "cc_server.cli", "serve", "--port", "0", "--log-json"],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    while time.monotonic() < deadline:
        events = []
        with open(log_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue
        listening = [e for e in events if e.get("event") == "listening"]
        if listening:
            token_path = next(e["path"] for e in events if e.get("event") == "token")
            with open(token_path, encoding="ascii") as f:
                token = f.read().strip()
            return proc, log_path, int(listening[0]["port"]), token
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    with open(log_path, encoding="utf-8", errors="replace") as f:
        raise SystemExit(f"the server did not start:\n{f.read()}")


def print_server_errors(log_path: str) -> None:
    """The server's warning and error lines, for a run that failed."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f if '"level": "warning"' in line or '"level": "error"' in line]
    print(f"the server logged {len(lines)} warnings and errors:", *lines[-20:], sep="\n",
          file=sys.stderr)


def resources(pid: int) -> tuple[int, int]:
    """(open fds, child processes) of `pid`."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    children: set[str] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as f:
                children.update(f.read().split())
        except OSError:
            continue
    return fds, len(children)


def cpu_s(pid: int) -> tuple[float, float]:
    """(the process's own CPU s, its reaped children's CPU s)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM), MiB."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise ValueError(f"no VmHWM for {pid}")


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run_load(workers: int, per_worker: int,
                   one: Callable[[int], Awaitable[None]]) -> tuple[float, list[float]]:
    """`workers` concurrent loops of `per_worker` sequential calls; (wall s, latencies s)."""
    latencies: list[float] = []

    async def worker(index: int) -> None:
        for _ in range(per_worker):
            start = time.perf_counter()
            await one(index)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for i in range(workers):
            tg.create_task(worker(i), name=f"worker {i}")
    return time.perf_counter() - start, latencies


def raw_argv(bwrap: str, work: str) -> list[str]:
    lib64 = ["--symlink", "usr/lib64", "/lib64"] if os.path.exists("/lib64") else []
    return [bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--disable-userns", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", "--ro-bind", "/usr", "/usr",
            "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib", *lib64,
            "--proc", "/proc", "--dev", "/dev", "--bind", work, work, "--", "/bin/true"]


async def bench_raw(bwrap: str, work: str, workers: int, per_worker: int
                    ) -> tuple[float, list[float]]:
    argv = raw_argv(bwrap, work)

    async def one(_index: int) -> None:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.DEVNULL, env={})
        assert await proc.wait() == 0

    return await run_load(workers, per_worker, one)


async def bench_server(url: str, token: str, work: str, workers: int, per_worker: int,
                       via: str, pid: int | None = None
                       ) -> tuple[float, float, list[float], tuple[float, float]]:
    """(create s, load wall s, latencies s, server `pid`'s CPU once the sandboxes are created
    and their streams open, just before the load)."""
    headers = {"Authorization": f"Bearer {token}"}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(url, headers=headers, connector=connector) as client:
        ids = [f"bench-{i}" for i in range(workers)]

        async def create(session_id: str) -> None:
            async with client.post("/v1/sandboxes", json={"spec": {
                "sessionId": session_id, "workspaceId": "bench",
                "bindMounts": [{"hostPath": work}]}}) as response:
                assert response.status == 201, await response.text()

        start = time.perf_counter()
        await asyncio.gather(*(create(i) for i in ids))
        create_s = time.perf_counter() - start

        async def one_ws(index: int) -> None:
            async with client.ws_connect(f"/v1/sandboxes/{ids[index]}/exec/ws") as ws:
                await ws.send_json({"argv": ["/bin/true"]})
                async for msg in ws:
                    event = msg.json()
                    if event["type"] == "exit":
                        assert event["exitCode"] == 0, event
                        return
            raise AssertionError("no exit event")

        async def one_post(index: int) -> None:
            async with client.post(f"/v1/sandboxes/{ids[index]}/exec",
                                   json={"argv": ["/bin/true"]}) as response:
                assert (await response.json())["exitCode"] == 0

        # The session stream: one WebSocket per sandbox, opened before the load, many commands.
        streams: list[aiohttp.ClientWebSocketResponse] = []
        if via == "session":
            streams = list(await asyncio.gather(*(
                client.ws_connect(f"/v1/sandboxes/{i}/session/ws") for i in ids)))
        sent = [0] * workers
        loaded = cpu_s(pid) if pid is not None else (0.0, 0.0)

        async def one_session(index: int) -> None:
            ws, sent[index] = streams[index], sent[index] + 1
            command_id = str(sent[index])
            await ws.send_json({"id": command_id, "exec": {"argv": ["/bin/true"]}})
            async for msg in ws:
                event = msg.json()
                assert event["id"] == command_id, event
                if event["type"] == "exit":
                    assert event["exitCode"] == 0, event
                    return
            raise AssertionError("no exit event")

        one = {"ws": one_ws, "post": one_post, "session": one_session}[via]
        wall, latencies = await run_load(workers, per_worker, one)
        for ws in streams:
            await ws.close()
        await asyncio.gather(*(client.delete(f"/v1/sandboxes/{i}") for i in ids))
    return create_s, wall, latencies, loaded


async def bench_library(work: str, workers: int, per_worker: int) -> tuple[float, list[float]]:
    from cc_server.backends.probe import probe
    from cc_server.policy import HostFacts, parse_spec
    from cc_server.runtime.handle import run_collect
    from cc_server.runtime.port import SandboxManager

    manager = SandboxManager(probe_result=probe(), host=HostFacts.current())
    try:
        handles = [manager.launch(parse_spec({
            "sessionId": f"lib-{i}", "workspaceId": "bench", "bindMounts": [{"hostPath": work}],
        })) for i in range(workers)]

        async def one(index: int) -> None:
            result = await run_collect(handles[index], ["/bin/true"])
            assert result.exit_code == 0, result

        return await run_load(workers, per_worker, one)
    finally:
        await manager.aclose()


def probe_healthz(port: int, stop: threading.Event, limit: int | None = None) -> list[float]:
    """Seconds per `GET /healthz` over one keep-alive connection, every HEALTHZ_EVERY_S, until
    `stop` is set (or `limit` probes). Runs in a thread: this process's event loop reading the
    big result must not be what delays a probe."""
    latencies: list[float] = []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=BIG_EXEC_TIMEOUT_S)
    try:
        while not stop.is_set() and (limit is None or len(latencies) < limit):
            start = time.perf_counter()
            conn.request("GET", "/healthz")
            response = conn.getresponse()
            response.read()
            latencies.append(time.perf_counter() - start)
            assert response.status == 200, response.status
            time.sleep(HEALTHZ_EVERY_S)
    finally:
        conn.close()
    return latencies


def latency_line(name: str, samples: list[float]) -> str:
    return (f"{name:22} {len(samples):7d} {percentile(samples, 0.5) * 1000:8.2f} "
            f"{percentile(samples, 0.99) * 1000:8.2f} {max(samples) * 1000:8.2f}")


async def bench_healthz_during_big_exec(url: str, port: int, token: str, work: str,
                                        exec_bytes: int, pid: int) -> None:
    """Print /healthz latency idle and during one POST exec of `exec_bytes` of stdout."""
    idle = await asyncio.to_thread(probe_healthz, port, threading.Event(), IDLE_PROBES)
    headers = {"Authorization": f"Bearer {token}"}
    timeout = aiohttp.ClientTimeout(total=BIG_EXEC_TIMEOUT_S)
    async with aiohttp.ClientSession(url, headers=headers, timeout=timeout) as client:
        async with client.post("/v1/sandboxes", json={"spec": {
            "sessionId": "bench-big", "workspaceId": "bench",
            "bindMounts": [{"hostPath": work}]}}) as response:
            assert response.status == 201, await response.text()
        stop = threading.Event()
        prober = asyncio.create_task(asyncio.to_thread(probe_healthz, port, stop),
                                     name="healthz prober")
        start = time.perf_counter()
        try:
            # The body goes to a file a piece at a time: joining ~120 MiB here would hold this
            # process's GIL, and the prober thread with it.
            with tempfile.TemporaryFile(dir=work) as spool:
                async with client.post("/v1/sandboxes/bench-big/exec", json={
                    "argv": ["head", "-c", str(exec_bytes), "/dev/zero"]}) as response:
                    assert response.status == 200, await response.text()
                    async for chunk in response.content.iter_chunked(2**16):
                        spool.write(chunk)
                exec_s = time.perf_counter() - start
                stop.set()
                spool.seek(0)
                body = spool.read()
        finally:
            stop.set()
            during = await prober
        async with client.delete("/v1/sandboxes/bench-big"):
            pass
    result = await asyncio.to_thread(json.loads, body)
    print(f"/healthz while POST .../exec sends {exec_bytes} bytes of stdout "
          f"(head -c {exec_bytes} /dev/zero); {os.cpu_count()} CPUs")
    print(f"exec: {exec_s:.1f} s, body {len(body) / 2**20:.0f} MiB, stdoutTruncated "
          f"{result['stdoutTruncated']}, stdoutDroppedBytes {result['stdoutDroppedBytes']}, "
          f"kept {len(result['stdout'])} bytes; server peak RSS {peak_rss_mib(pid):.0f} MiB")
    print(f"{'/healthz':22} {'probes':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    print(latency_line("idle", idle))
    print(latency_line("during the exec", during))


def _own_cpu_s() -> float:
    """CPU seconds this process has used so far (user + system)."""
    times = os.times()
    return times.user + times.system


async def warm_up(url: str, token: str, work: str) -> None:
    await bench_server(url, token, work, 1, 1, "ws")


async def steady(pid: int) -> tuple[int, int]:
    """The server's resources once they stop changing (three equal samples 0.2 s apart)."""
    samples = [resources(pid)]
    deadline = time.monotonic() + SETTLE_S
    while (len(samples) < 3 or len(set(samples[-3:])) > 1) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        samples.append(resources(pid))
    return samples[-1]


async def settle(pid: int, idle: tuple[int, int]) -> tuple[int, int]:
    deadline = time.monotonic() + SETTLE_S
    now = resources(pid)
    while now != idle and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        now = resources(pid)
    return now


async def main_async(args: argparse.Namespace) -> int:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        print("bwrap is not installed (scripts/bootstrap installs it)", file=sys.stderr)
        return 1
    work = tempfile.mkdtemp(prefix="cc-bench-server-")
    runtime = tempfile.mkdtemp(prefix="ccb-", dir="/tmp")
    proc, log_path, port, token = start_server(work, runtime, args.profile)
    url = f"http://127.0.0.1:{port}"
    try:
        await warm_up(url, token, work)
        if args.big_exec_bytes:
            await bench_healthz_during_big_exec(url, port, token, work, args.big_exec_bytes,
                                                proc.pid)
            if args.big_exec_only:
                return 0
            print()
        idle = await steady(proc.pid)
        n = args.sandboxes * args.commands

        raw_wall, raw_lat = await bench_raw(bwrap, work, args.sandboxes, args.commands)
        mine = os.times()  # the library runs in this process
        lib_wall, lib_lat = await bench_library(work, args.sandboxes, args.commands)
        lib_cpu = _own_cpu_s() - (mine.user + mine.system)
        cpu_before = cpu_s(proc.pid)
        mine_before = _own_cpu_s()
        create_s, srv_wall, srv_lat, cpu_loaded = await bench_server(
            url, token, work, args.sandboxes, args.commands, args.via, proc.pid)
        client_cpu = _own_cpu_s() - mine_before
        cpu_after = cpu_s(proc.pid)
        after = await settle(proc.pid, idle)

        raw_rate, lib_rate, srv_rate = n / raw_wall, n / lib_wall, n / srv_wall
        rows = [
            ("raw bwrap", raw_rate, percentile(raw_lat, 0.5), percentile(raw_lat, 0.99)),
            ("library", lib_rate, percentile(lib_lat, 0.5), percentile(lib_lat, 0.99)),
            (f"server ({args.via})", srv_rate, percentile(srv_lat, 0.5),
             percentile(srv_lat, 0.99)),
        ]
        print(f"{args.sandboxes} sandboxes x {args.commands} commands = {n} commands, "
              f"{args.sandboxes} concurrent; {os.cpu_count()} CPUs")
        print(f"created {args.sandboxes} sandboxes in {create_s * 1000:.0f} ms")
        print(f"{'':16} {'commands/s':>11} {'p50 ms':>8} {'p99 ms':>8}")
        for name, rate, p50, p99 in rows:
            print(f"{name:16} {rate:11.1f} {p50 * 1000:8.1f} {p99 * 1000:8.1f}")
        print(f"{'server/raw':16} {srv_rate / raw_rate:11.2f} "
              f"{percentile(srv_lat, 0.5) / percentile(raw_lat, 0.5):8.2f} "
              f"{percentile(srv_lat, 0.99) / percentile(raw_lat, 0.99):8.2f}"
              "   (throughput ratio; latency ratios)")
        print(f"{'server/library':16} {srv_rate / lib_rate:11.2f} "
              f"{percentile(srv_lat, 0.5) / percentile(lib_lat, 0.5):8.2f} "
              f"{percentile(srv_lat, 0.99) / percentile(lib_lat, 0.99):8.2f}")
        print(f"mean latency: raw {statistics.mean(raw_lat) * 1000:.1f} ms, "
              f"server {statistics.mean(srv_lat) * 1000:.1f} ms")
        print(f"server CPU per command: {(cpu_after[0] - cpu_before[0]) / n * 1000:.1f} ms in "
              f"the server process, {(cpu_after[1] - cpu_before[1]) / n * 1000:.1f} ms in its "
              "sandboxes (bwrap, launcher, command); without the creates and stream opens: "
              f"{(cpu_after[0] - cpu_loaded[0]) / n * 1000:.2f} ms in the server process")
        print(f"library CPU per command: {lib_cpu / n * 1000:.1f} ms (this process); the server's "
              f"client: {client_cpu / n * 1000:.1f} ms (this process, sharing the CPUs with it)")
        back = after == idle
        print(f"server fds/children: idle {idle[0]}/{idle[1]}, after {after[0]}/{after[1]} "
              f"({'back to idle' if back else 'NOT back to idle'})")
        return 0 if back else 1
    except BaseException:
        print_server_errors(log_path)
        raise
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", type=int, default=50)
    parser.add_argument("--commands", type=int, default=20, help="per sandbox")
    parser.add_argument("--via", choices=["session", "ws", "post"], default="session",
                        help="session: one session stream per sandbox; ws: an exec WebSocket "
                        "per command; post: POST .../exec")
    parser.add_argument("--big-exec-bytes", type=int, default=2**30,
                        help="stdout of the exec /healthz is timed during (0: skip)")
    parser.add_argument("--profile", metavar="FILE",
                        help="run the server under cProfile (CPU time) and write its stats to FILE "
                        "(read them with python -m pstats FILE)")
    parser.add_argument("--big-exec-only", action="store_true",
                        help="only time /healthz during the big exec; no load")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
