#!/usr/bin/env python3
"""Cost of the write policy decided when a write happens, against the same sandbox without it,
in one run.

Each workload runs inside four native sandboxes per round, rounds interleaved so drift hits all
alike, the order rotating from round to round:

  plain    no supervisor (CC_SERVER_WRITE_PROTECTION=launch-time, no globs): the baseline;
  globs    the standard create-time globs only (.env, *.key, *.pem), launch-time binds;
  default  the default write protection (the protected patterns at any depth: creates, opens
           for writing, renames, removals and mode changes trapped and judged on their path);
  both     the default protection and the globs (what a dispatch run gets).

Times are taken inside the sandbox, around the workload only (sandbox start-up excluded), and
the medians are compared with plain:

  unpack      tar xf of a FILES-file tarball (FILES/100 directories) into a new directory on
              the workspace's filesystem; every file is one supervised create. Target <= 1.6x.
  git status  on a FILES-file repository (reads and stats; the index lock is one create).
              Target <= 1.05x: reads never reach the supervisor.
  per create  a Python loop of O_CREAT|O_EXCL opens; (x - plain) / n is the cost one create
              pays, in microseconds; (both - globs) / n is what the path check adds to one
              (target <= 20 us).
  per write   a Python loop opening existing files O_WRONLY (trapped only with the protection).

"best-of" is the fastest supervised run over the fastest plain one: other work on the machine
only ever adds time, so on a shared machine it is the steadier of the two ratios.

Nothing is deleted between rounds (each round unpacks into a fresh directory): on an ext4 without
a journal, creating right after deleting many inodes is several times slower, which would swamp
what is measured here. Everything is removed at the end.

Usage: .venv/bin/python bench/create_rules.py [--files N] [--rounds N] [--dir DIR] [--library SO]

--library runs the supervisor from another build of the library (to measure a change before
scripts/bootstrap installs it, or against an older build): one .so from all of
src/cc_server/backends/native/supervisor*.c, with the flags of scripts/bootstrap's line
(-fvisibility=hidden among them); the launcher stays the probe's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

from cc_server.backends.probe import CREATE_SUPERVISOR_TOOL, probe
from cc_server.policy import STANDARD_DENY_CREATE_GLOBS, HostFacts, parse_spec
from cc_server.runtime.handle import SandboxHandle, run_collect
from cc_server.runtime.port import SandboxManager
from cc_server.runtime.select import WRITE_PROTECTION_ENV

PYTHON = "/usr/bin/python3"  # inside the sandbox
TIMED = 'a=$(date +%s%N); {cmd}; r=$?; b=$(date +%s%N); echo "$((b - a))"; exit $r'
CREATE_LOOP = (
    "import os, sys\n"
    "d, n = sys.argv[1], int(sys.argv[2])\n"
    "os.mkdir(d)\n"
    "for i in range(n):\n"
    "    os.close(os.open(f'{d}/f{i}', os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))\n"
)
WRITE_LOOP = (
    "import os, sys\n"
    "d, n = sys.argv[1], int(sys.argv[2])\n"
    "for i in range(n):\n"
    "    os.close(os.open(f'{d}/f{i}', os.O_WRONLY))\n"
)
VARIANTS = ("plain", "globs", "default", "both")


def _make_tree(root: str, files: int) -> None:
    per_dir = 100
    for i in range(files):
        d = os.path.join(root, f"d{i // per_dir:04d}")
        if i % per_dir == 0:
            os.makedirs(d)
        with open(os.path.join(d, f"file{i:05d}.txt"), "w") as f:
            f.write(f"line {i}\n" * 4)


def _fs_type(path: str) -> str:
    out = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True)
    return out.stdout.strip() or "?"


async def _timed(handle: SandboxHandle, cmd: str, cwd: str) -> float:
    result = await run_collect(
        handle, ["/bin/sh", "-c", TIMED.format(cmd=cmd)], cwd=cwd, timeout_s=600
    )
    if result.exit_code != 0:
        raise RuntimeError(f"{cmd!r} failed ({result.exit_code}): {result.stderr.decode()}")
    return int(result.stdout.decode().split()[-1]) / 1e9


async def _bench(work: str, files: int, rounds: int, library: str | None) -> int:
    repo = os.path.join(work, "repo")
    tree = os.path.join(work, "tree")
    tarball = os.path.join(work, "tree.tar")
    print(f"preparing {files} files under {work} ({_fs_type(work)}) ...", flush=True)
    _make_tree(tree, files)
    with tarfile.open(tarball, "w") as tar:
        tar.add(tree, arcname="tree")
    shutil.copytree(tree, repo)
    git = ["git", "-C", repo, "-c", "user.name=b", "-c", "user.email=b@example.invalid"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "tree"]):
        subprocess.run([*git, *args], check=True)
    with open(os.path.join(work, "loop.py"), "w") as f:
        f.write(CREATE_LOOP)
    with open(os.path.join(work, "write.py"), "w") as f:
        f.write(WRITE_LOOP)

    result = probe()
    if not result.create_rules:
        print(f"no create-rule supervisor on this host: {result.create_rules_hint}")
        return 1
    if library:
        tools = {**result.tools, CREATE_SUPERVISOR_TOOL: os.path.abspath(library)}
        result = dataclasses.replace(result, tools=tools)
    manager = SandboxManager(probe_result=result, host=HostFacts.current())
    spec = {"workspaceId": "bench", "bindMounts": [{"hostPath": work}]}
    handles: dict[str, SandboxHandle] = {}
    for name in VARIANTS:
        globs = STANDARD_DENY_CREATE_GLOBS if name in ("globs", "both") else ()
        launch_time = name in ("plain", "globs")
        saved = os.environ.get(WRITE_PROTECTION_ENV)
        if launch_time:  # read when the policy is compiled, at launch
            os.environ[WRITE_PROTECTION_ENV] = "launch-time"
        try:
            handles[name] = manager.launch(
                parse_spec({"sessionId": name, **spec}), deny_create_globs=globs
            )
        finally:
            if launch_time:
                os.environ.pop(WRITE_PROTECTION_ENV)
                if saved is not None:
                    os.environ[WRITE_PROTECTION_ENV] = saved
    samples: dict[tuple[str, str], list[float]] = {}
    try:
        git_status = f"git -C {repo} status --porcelain >/dev/null"
        await _timed(handles["plain"], git_status, work)  # warm caches
        for rnd in range(rounds):
            shift = rnd % len(VARIANTS)
            for name in VARIANTS[shift:] + VARIANTS[:shift]:
                dest = os.path.join(work, f"out-{name}-{rnd}")
                os.mkdir(dest)
                workloads = {
                    "unpack": f"tar xf {tarball} -C {dest}",
                    "git status": git_status,
                    "per create": f"{PYTHON} loop.py {dest}/loop {files}",
                    "per write": f"{PYTHON} write.py {dest}/loop {files}",
                }
                for workload, cmd in workloads.items():
                    seconds = await _timed(handles[name], cmd, work)
                    samples.setdefault((workload, name), []).append(seconds)
            print(f"round {rnd + 1}/{rounds} done", flush=True)
    finally:
        await manager.aclose()

    def med(workload: str, name: str) -> float:
        return statistics.median(samples[(workload, name)])

    def best(workload: str, name: str) -> float:
        return min(samples[(workload, name)])

    print(f"\n{files} files, {rounds} rounds, medians (seconds, inside the sandbox); each")
    print("variant as a ratio to plain, median (best-of):")
    heads = "".join(f" {v:>16}" for v in VARIANTS[1:])
    print(f"{'workload':<12} {'plain':>8}{heads}  target")
    targets = {"unpack": "<= 1.6x", "git status": "<= 1.05x", "per create": "", "per write": ""}
    for workload, target in targets.items():
        p = med(workload, "plain")
        cells = "".join(
            f" {med(workload, v) / p:7.2f}x ({best(workload, v) / best(workload, 'plain'):5.2f}x)"
            for v in VARIANTS[1:]
        )
        print(f"{workload:<12} {p:8.3f}{cells}  {target}")
    for workload in ("per create", "per write"):
        extra = {v: (med(workload, v) - med(workload, "plain")) / files * 1e6 for v in VARIANTS}
        print(f"\n{workload}: " + ", ".join(f"{v} +{extra[v]:.1f} us" for v in VARIANTS[1:]))
    check = (med("per create", "both") - med("per create", "globs")) / files * 1e6
    print(f"the path check adds {check:.1f} us to one create (both - globs; target <= 20 us)")
    return 0


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", help="where the workspace lives (default: the temp directory)")
    parser.add_argument("--library", help="the supervisor library to use (default: the probe's)")
    args = parser.parse_args()
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="cc-bench-create-", dir=args.dir)
    started = time.monotonic()
    print(f"load average at start: {_load()}")
    try:
        return asyncio.run(_bench(work, args.files, args.rounds, args.library))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        took = time.monotonic() - started
        print(f"(took {took:.0f} s; load average at the end: {_load()})", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
