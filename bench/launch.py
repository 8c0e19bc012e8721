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
  cli       `cc-server run -- /bin/true` as a new process: the venv's `cc-server` (the C client
            scripts/bootstrap installs, else pip's wrapper of the Python one), served by the
            user's CLI daemon (started by the warm-up run, stopped at the end)
  cli-py    the same through the Python client (`python -m cc_server.cli_client`)
  cli-inproc  the same with CC_SERVER_DAEMON=off: everything in the new process
  srt       Anthropic's sandbox-runtime, `srt /bin/true` with the same directory writable and no
            network allowed (installed by this bench from the npm registry, pinned, into
            ~/.cache/cc-server-bench/srt; skipped with a message when it cannot be, or --no-srt)
each as a ratio to raw bwrap. Targets: library <= 1.5x raw bwrap; CLI <= 50 ms median and at
least 4x faster than srt in the same run.

Usage: .venv/bin/python bench/launch.py [--runs N] [--no-srt]
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import platform
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


SRT_PACKAGE = "@anthropic-ai/sandbox-runtime"
SRT_VERSION = "0.0.83"
SRT_PREFIX = os.path.expanduser("~/.cache/cc-server-bench/srt")
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _srt() -> str | None:
    """The pinned srt, installed into SRT_PREFIX on first use; None (said why) if it cannot be."""
    binary = os.path.join(SRT_PREFIX, "node_modules", ".bin", "srt")
    manifest = os.path.join(SRT_PREFIX, "node_modules", *SRT_PACKAGE.split("/"), "package.json")
    try:
        with open(manifest, encoding="utf-8") as f:
            installed = json.load(f).get("version")
    except (OSError, ValueError):
        installed = None
    if installed != SRT_VERSION or not os.access(binary, os.X_OK):
        npm = shutil.which("npm")
        if npm is None or shutil.which("node") is None:
            print("srt: skipped (node and npm are not installed)", file=sys.stderr)
            return None
        print(f"srt: installing {SRT_PACKAGE}@{SRT_VERSION} into {SRT_PREFIX}", file=sys.stderr)
        done = subprocess.run(
            [npm, "install", "--prefix", SRT_PREFIX, "--no-audit", "--no-fund", "--no-save",
             "--loglevel=error", f"{SRT_PACKAGE}@{SRT_VERSION}"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0 or not os.access(binary, os.X_OK):
            print(f"srt: skipped (npm install failed: {done.stderr.strip()[-300:]})",
                  file=sys.stderr)
            return None
    return binary


def _ripgrep() -> str | None:
    """srt scans the working directory with ripgrep: the one on PATH, else the one the
    dispatch tests' npm packages ship (scripts/bootstrap --test)."""
    found = shutil.which("rg")
    if found is not None:
        return found
    arch = {"x86_64": "x64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    pattern = f"{CHECKOUT}/.cache/npm/node_modules/**/vendor/ripgrep/{arch}-linux/rg"
    return next(iter(sorted(glob.glob(pattern, recursive=True))), None)


def _srt_case(work: str, settings_dir: str) -> Callable[[], object] | None:
    srt = _srt()
    if srt is None:
        return None
    rg = _ripgrep()
    if rg is None:
        print("srt: skipped (it needs ripgrep: apt-get install ripgrep, or scripts/bootstrap "
              "--test)", file=sys.stderr)
        return None
    settings = os.path.join(settings_dir, "srt-settings.json")
    with open(settings, "w", encoding="utf-8") as f:
        json.dump({"network": {"allowedDomains": [], "deniedDomains": []},
                   "filesystem": {"denyRead": [], "allowWrite": [work], "denyWrite": []},
                   "ripgrep": {"command": rg}}, f)
    argv = [srt, "--settings", settings, "/bin/true"]
    probe = subprocess.run(argv, cwd=work, capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        print(f"srt: skipped (it failed here: {probe.stderr.strip()[-300:]})", file=sys.stderr)
        return None
    return lambda: subprocess.run(argv, cwd=work, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--no-srt", action="store_true", help="leave out the srt baseline")
    options = parser.parse_args()
    runs = options.runs
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        print("bwrap is not installed (scripts/bootstrap installs it)", file=sys.stderr)
        return 1
    work = tempfile.mkdtemp(prefix="cc-bench-")
    settings_dir = tempfile.mkdtemp(prefix="cc-bench-srt-")
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
        cli_argv = ["run", "--bind", work, "--", "/bin/true"]
        srt = None if options.no_srt else _srt_case(work, settings_dir)
        try:
            medians = _time_interleaved(
                {
                    "bare": lambda: subprocess.run(["/bin/true"], check=True),
                    "bwrap": lambda: subprocess.run(raw, check=True),
                    "nobridge": lambda: run_attached(plain),
                    "library": library,
                    "first": first,
                    "cli": lambda: subprocess.run([cli_bin, *cli_argv], cwd=work, check=True),
                    "cli-py": lambda: subprocess.run(
                        [sys.executable, "-m", "cc_server.cli_client", *cli_argv], cwd=work,
                        check=True,
                    ),
                    "cli-inproc": lambda: subprocess.run(
                        [cli_bin, *cli_argv], cwd=work, check=True,
                        env={**os.environ, "CC_SERVER_DAEMON": "off"},
                    ),
                    **({"srt": srt} if srt is not None else {}),
                },
                runs,
            )
        finally:
            loop.run_until_complete(manager.aclose())
            loop.close()
            subprocess.run([cli_bin, "daemon", "stop"], check=False, stdout=subprocess.DEVNULL)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(settings_dir, ignore_errors=True)

    raw_bwrap, lib, cli = medians["bwrap"], medians["library"], medians["cli"]
    with open(cli_bin, "rb") as f:
        kind = "pip's wrapper of the Python client" if f.read(2) == b"#!" else "the C client"
    print(f"runs per case: {runs} (median wall time; the cases take turns); cli is {kind}")
    print(f"{'case':<12}{'median ms':>12}{'x raw bwrap':>14}")
    for name, value in medians.items():
        print(f"{name:<12}{value * 1000:>12.2f}{value / raw_bwrap:>14.2f}")
    print(f"library/bwrap = {lib / raw_bwrap:.2f} (target <= 1.5); "
          f"cli = {cli * 1000:.1f} ms (target <= 50)")
    if "srt" in medians:
        print(f"srt/cli = {medians['srt'] / cli:.2f} (target >= 4)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
