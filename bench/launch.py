#!/usr/bin/env python3
"""Launch overhead, measured in one run against baselines measured in the same run.

Prints the median wall time of:
  bare      /bin/true as a plain child process
  bwrap     raw bwrap with the same namespaces cc-server uses, running /bin/true
  nobridge  the same bwrap plan cc-server builds, without the egress bridge and the write
            policy's supervisor, run directly
  library   cc-server native exec of /bin/true through the library API (warm process) in a
            session that has run a command before: the plan is made and checked again, and the
            command goes to the session's sandbox (its launcher starts it)
  first     the first exec of a new session through the library API: launch, exec, destroy;
            this starts the session's sandbox (bwrap, the egress handoff to the session's
            proxies) and closes it
  cli       `cc-server run -- /bin/true` as a new process: the thin client, served by the user's
            CLI daemon (started by the warm-up run, stopped at the end)
  cli-inproc  the same with CC_SERVER_DAEMON=off: everything in the new process
each as a ratio to raw bwrap. Targets: library <= 1.5x raw bwrap; CLI <= 100 ms median.

Usage: .venv/bin/python bench/launch.py [--runs N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from cc_server.backends.plan import Command
from cc_server.backends.probe import probe
from cc_server.backends.runner import run_attached
from cc_server.policy import HostFacts, compile_policy, parse_spec
from cc_server.runtime.handle import run_collect
from cc_server.runtime.port import SandboxManager


def _time_interleaved(cases: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    """The median wall time of each case; the cases take turns, one run each per round, so a
    load spike on this noisy machine hits every case alike instead of one case's whole block."""
    for fn in cases.values():
        fn()  # warm-up, not counted
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    runs = parser.parse_args().runs
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        print("bwrap is not installed (scripts/bootstrap installs it)", file=sys.stderr)
        return 1
    work = tempfile.mkdtemp(prefix="cc-bench-")
    try:
        raw = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
               "--unshare-uts", "--unshare-cgroup-try", "--disable-userns", "--die-with-parent",
               "--new-session", "--cap-drop", "ALL", "--ro-bind", "/usr", "/usr",
               "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
               "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev",
               "--bind", work, work, "--", "/bin/true"]
        manager = SandboxManager(probe_result=probe(), host=HostFacts.current())
        handle = manager.launch(
            parse_spec({"sessionId": "bench", "workspaceId": "bench",
                        "bindMounts": [{"hostPath": work}]})
        )
        loop = asyncio.new_event_loop()

        def library() -> None:
            result = loop.run_until_complete(run_collect(handle, ["/bin/true"]))
            assert result.exit_code == 0, result

        sessions = iter(range(1_000_000))

        def first() -> None:
            fresh = manager.launch(
                parse_spec({"sessionId": f"first-{next(sessions)}", "workspaceId": "bench",
                            "bindMounts": [{"hostPath": work}]})
            )
            result = loop.run_until_complete(run_collect(fresh, ["/bin/true"]))
            loop.run_until_complete(manager.destroy(fresh.session_id))
            assert result.exit_code == 0, result

        # The plan without the default write policy's supervisor: it runs attached, as is.
        bare_policy = compile_policy(
            parse_spec({"sessionId": "plain", "workspaceId": "bench",
                        "bindMounts": [{"hostPath": work}]}), HostFacts.current())
        plain = handle.planner.plan(bare_policy, Command(argv=("/bin/true",)))
        cli_bin = os.path.join(os.path.dirname(sys.executable), "cc-server")
        try:
            medians = _time_interleaved(
                {
                    "bare": lambda: subprocess.run(["/bin/true"], check=True),
                    "bwrap": lambda: subprocess.run(raw, check=True),
                    "nobridge": lambda: run_attached(plain),
                    "library": library,
                    "first": first,
                    "cli": lambda: subprocess.run(
                        [cli_bin, "run", "--bind", work, "--", "/bin/true"], check=True
                    ),
                    "cli-inproc": lambda: subprocess.run(
                        [cli_bin, "run", "--bind", work, "--", "/bin/true"], check=True,
                        env={**os.environ, "CC_SERVER_DAEMON": "off"},
                    ),
                },
                runs,
            )
        finally:
            loop.run_until_complete(manager.aclose())
            loop.close()
            subprocess.run([cli_bin, "daemon", "stop"], check=False, stdout=subprocess.DEVNULL)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    raw_bwrap, lib, cli = medians["bwrap"], medians["library"], medians["cli"]
    print(f"runs per case: {runs} (median wall time; the cases take turns)")
    print(f"{'case':<12}{'median ms':>12}{'x raw bwrap':>14}")
    for name, value in medians.items():
        print(f"{name:<12}{value * 1000:>12.2f}{value / raw_bwrap:>14.2f}")
    print(f"library/bwrap = {lib / raw_bwrap:.2f} (target <= 1.5); "
          f"cli = {cli * 1000:.1f} ms (target <= 100)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
