#!/usr/bin/env python3
"""Cost of the in-process file tools' checks, against plain file access, in one run.

The tools run the guardrail chain, map the guest path, open the bind root and the file through
openat2 (RESOLVE_BENEATH) and check the opened descriptor's real path before reading. The
baseline is the same work without any of it: `open(path).read()` and an `os.walk` + `re` search.
Rounds interleave both sides so drift hits them alike; medians are compared:

  read     every file of a FILES-file tree once per round (FileTools.read vs open().read()).
           Target <= 10x: the checks are a handful of syscalls around a small read.
  write    every file rewritten once per round (FileTools.write vs open(path, 'w').write()).
           Target <= 10x.
  search   one regex over the whole tree (FileTools.search vs os.walk + re per line).
           Target <= 2x: per-file checks are small next to reading and matching.

Usage: .venv/bin/python bench/file_tools.py [--files N] [--rounds N] [--resolver openat2|walk]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

from cc_server.dispatch._resolve import Openat2Resolver, Resolver, WalkResolver
from cc_server.dispatch.guardrails import standard_chain
from cc_server.dispatch.tools import FileTools
from cc_server.policy import (
    STANDARD_DENY_CREATE_GLOBS,
    HostFacts,
    SandboxBindMount,
    SandboxSpec,
    compile_policy,
    detect_platform,
)

TARGETS = {"read": 10.0, "write": 10.0, "search": 2.0}
LINE = "def function_{i}(value):  # a line of ordinary source text\n"


def _tree(root: str, files: int) -> list[str]:
    rels = []
    for i in range(files):
        rel = f"pkg{i % 50}/mod{i}.py"
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("".join(LINE.format(i=i * 40 + j) for j in range(40)))
        rels.append(rel)
    return rels


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--resolver", choices=("openat2", "walk"), default="openat2")
    args = parser.parse_args()

    base = tempfile.mkdtemp(prefix="cc-bench-tools-")
    try:
        home = os.path.join(base, "home")
        wt = os.path.join(base, "wt")
        os.makedirs(os.path.join(home, ".ssh"))
        os.makedirs(wt)
        rels = _tree(wt, args.files)
        spec = SandboxSpec(
            session_id="bench",
            workspace_id="bench",
            bind_mounts=(SandboxBindMount(host_path=wt),),
            guest_workdir=wt,
        )
        host = HostFacts(
            platform=detect_platform(),
            home=home,
            realpath=os.path.realpath,
            exists=os.path.lexists,
        )
        policy = compile_policy(spec, host, deny_create_globs=STANDARD_DENY_CREATE_GLOBS)
        resolver: Resolver = Openat2Resolver() if args.resolver == "openat2" else WalkResolver()
        tools = FileTools(policy, standard_chain(policy), resolver=resolver)
        content = LINE.format(i=0) * 40
        pattern = r"function_\d*7\("
        regex = re.compile(pattern)

        def plain_read() -> None:
            for rel in rels:
                with open(os.path.join(wt, rel)) as f:
                    f.read()

        def tools_read() -> None:
            for rel in rels:
                tools.read(rel)

        def plain_write() -> None:
            for rel in rels:
                with open(os.path.join(wt, rel), "w") as f:
                    f.write(content)

        def tools_write() -> None:
            for rel in rels:
                tools.write(rel, content)

        def plain_search() -> None:
            found = 0
            for dirpath, dirnames, filenames in os.walk(wt):
                dirnames[:] = [d for d in dirnames if d != ".git"]
                for name in filenames:
                    with open(os.path.join(dirpath, name), errors="replace") as f:
                        found += sum(1 for line in f if regex.search(line))

        def tools_search() -> None:
            tools.search(pattern)

        pairs = {
            "read": (plain_read, tools_read),
            "write": (plain_write, tools_write),
            "search": (plain_search, tools_search),
        }
        times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in pairs}
        for _ in range(args.rounds):
            for name, (plain, checked) in pairs.items():
                times[name][0].append(_timed(plain))
                times[name][1].append(_timed(checked))
        print(
            f"{args.files} files, {args.rounds} rounds, resolver {resolver.name}, "
            f"{os.cpu_count()} CPUs"
        )
        for name, (plain_t, checked_t) in times.items():
            p, c = statistics.median(plain_t), statistics.median(checked_t)
            ratio = c / p
            verdict = "met" if ratio <= TARGETS[name] else "NOT met"
            print(
                f"{name:7s} plain {p * 1e3:8.1f} ms  tools {c * 1e3:8.1f} ms  "
                f"ratio {ratio:5.2f} (target <= {TARGETS[name]:g}x: {verdict})  "
                f"per file +{(c - p) / args.files * 1e6:6.1f} us"
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
