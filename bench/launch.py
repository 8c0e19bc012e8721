#!/usr/bin/env python3
"""Launch overhead, measured in one run against baselines measured in the same run.

Prints the median wall time of:
  bare      /bin/true as a plain child process
  bwrap     raw bwrap with the same namespaces cc-server uses, running /bin/true
  nobridge  the same bwrap plan cc-server builds, without the egress bridge, run directly
  library   cc-server native exec of /bin/true through the library API (warm process), which
            includes the egress bridge (socat listeners in the sandbox) every native exec gets
  cli       `cc-server run -- /bin/true` as a new process
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
from cc_server.policy import HostFacts, parse_spec
from cc_server.runtime.handle import run_collect
from cc_server.runtime.port import SandboxManager


def _time(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm-up, not counted
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


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
        bare = _time(lambda: subprocess.run(["/bin/true"], check=True), runs)
        raw_bwrap = _time(lambda: subprocess.run(raw, check=True), runs)

        manager = SandboxManager(probe_result=probe(), host=HostFacts.current())
        handle = manager.launch(
            parse_spec({"sessionId": "bench", "workspaceId": "bench",
                        "bindMounts": [{"hostPath": work}]})
        )
        loop = asyncio.new_event_loop()

        def library() -> None:
            result = loop.run_until_complete(run_collect(handle, ["/bin/true"]))
            assert result.exit_code == 0, result

        lib = _time(library, runs)
        plain = handle.plan(Command(argv=("/bin/true",)))
        nobridge = _time(lambda: run_attached(plain), runs)
        loop.run_until_complete(manager.aclose())
        loop.close()

        cli_bin = os.path.join(os.path.dirname(sys.executable), "cc-server")
        cli = _time(
            lambda: subprocess.run([cli_bin, "run", "--bind", work, "--", "/bin/true"],
                                   check=True),
            runs,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"runs per case: {runs} (median wall time)")
    print(f"{'case':<10}{'median ms':>12}{'x raw bwrap':>14}")
    cases = (("bare", bare), ("bwrap", raw_bwrap), ("nobridge", nobridge), ("library", lib),
             ("cli", cli))
    for name, value in cases:
        print(f"{name:<10}{value * 1000:>12.2f}{value / raw_bwrap:>14.2f}")
    print(f"library/bwrap = {lib / raw_bwrap:.2f} (target <= 1.5); "
          f"cli = {cli * 1000:.1f} ms (target <= 100)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
