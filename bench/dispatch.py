#!/usr/bin/env python3
"""Cost of a conversation's worktree and of a dispatch run, against baselines in the same run.

  worktree    making (and removing) a worktree of a FILES-file git checkout with each strategy
              that works here, against `cp -a` of the same checkout (the naive full copy),
              rounds interleaved. Reported as ratios to the copy's median.
  dispatch    open_run + one harness `true` + close_run (spec, grant, launch with the standard
              create-time globs, guardrail chain, sandboxed command, teardown), against the
              manager launching the same spec and running the same `true` in it directly.
              Reported as the ratio of medians.

No test asserts these numbers. Usage: .venv/bin/python bench/dispatch.py [--files N] [--rounds N]
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
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec

from cc_server.backends.probe import probe
from cc_server.dispatch.service import AgentKind, DispatchConfig, DispatchService
from cc_server.dispatch.worktrees import (
    WorktreeManager,
    WorktreeStrategy,
    _try_overlay,
    _try_reflink,
    _umount,
    mounted_under,
)
from cc_server.policy import STANDARD_DENY_CREATE_GLOBS, HostFacts
from cc_server.runtime.handle import run_collect
from cc_server.runtime.port import SandboxManager


def make_checkout(root: str, files: int) -> str:
    repo = os.path.join(root, "repo")
    for i in range(files):
        d = os.path.join(repo, f"d{i // 100:03d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"f{i:05d}.txt"), "w") as f:
            f.write(f"file {i}\n" * 20)
    env = {"PATH": os.environ["PATH"], "HOME": root, "GIT_CONFIG_NOSYSTEM": "1"}
    for args in (["init", "-q"], ["add", "-A"],
                 ["-c", "gc.auto=0", "-c", "user.email=b@example.invalid", "-c", "user.name=b",
                  "commit", "-qm", "i"],
                 ["gc", "-q"]):  # packed, like a real checkout, and nothing left in the background
        subprocess.run(["git", *args], cwd=repo, env=env, check=True)
    return repo


def working(root: str) -> list[WorktreeStrategy]:
    out = []
    for strategy, attempt in ((WorktreeStrategy.OVERLAY, _try_overlay),
                              (WorktreeStrategy.REFLINK, _try_reflink)):
        scratch = tempfile.mkdtemp(dir=root)
        try:
            if attempt(scratch) is None:
                out.append(strategy)
        finally:
            shutil.rmtree(scratch)
    return [*out, WorktreeStrategy.GIT]


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_worktrees(root: str, repo: str, rounds: int) -> None:
    strategies = working(root)
    managers = {s: WorktreeManager(base=os.path.join(root, f"wt-{s}"), strategy=s)
                for s in strategies}
    for m in managers.values():
        m.register("r", repo)
    times: dict[str, list[float]] = {"cp -a": [], **{str(s): [] for s in strategies}}
    removal: dict[str, list[float]] = {str(s): [] for s in strategies}
    for i in range(rounds):
        target = os.path.join(root, f"copy-{i}")
        times["cp -a"].append(timed(lambda t=target: subprocess.run(  # type: ignore[misc]
            ["cp", "-a", repo, t], check=True, capture_output=True)))
        shutil.rmtree(target)
        for s, m in managers.items():
            made: list[Any] = []
            times[str(s)].append(timed(lambda m=m, made=made, i=i: made.append(  # type: ignore[misc]
                m.create("r", f"c{i}"))))
            removal[str(s)].append(timed(lambda m=m, w=made[0]: m.remove(w.worktree_id))) # type: ignore[misc]
    base = statistics.median(times["cp -a"])
    print(f"worktree of a {sum(len(f) for _, _, f in os.walk(repo))}-file checkout, "
          f"{rounds} rounds (medians):")
    for name, samples in times.items():
        med = statistics.median(samples)
        extra = f", removal {statistics.median(removal[name]) * 1000:.1f} ms" \
            if name in removal else ""
        print(f"  {name:8s} {med * 1000:8.1f} ms  {med / base:.3g}x cp -a{extra}")


async def bench_dispatch(root: str, repo: str, rounds: int) -> None:
    result = probe()
    home = os.path.join(root, "home")
    os.makedirs(home)
    host = dataclasses.replace(HostFacts.current(), home=home)
    manager = SandboxManager(probe_result=result, host=host)
    worktrees = WorktreeManager(base=os.path.join(root, "wt-dispatch"))
    worktrees.register("r", repo)
    wt = worktrees.create("r", "bench")

    class NoCredentials:
        def grant(self, spec: Any, run_id: str) -> Any:
            return type("G", (), {"env": {}, "bind_mounts": ()})()

        def admit(self, run_id: str, rule: Any) -> None: ...

        def revoke(self, run_id: str) -> None: ...

        def close(self) -> None: ...

    service = DispatchService(
        manager=manager, worktrees=worktrees, broker=NoCredentials(),
        config=DispatchConfig(state_base=os.path.join(root, "runs")),
        environ={"PATH": os.environ["PATH"], "HOME": home},
    )
    direct: list[float] = []
    dispatched: list[float] = []
    try:
        for i in range(rounds):
            start = time.perf_counter()
            run = await service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.HARNESS)
            done = await run.harness.run(["true"])
            await service.close_run(run.run_id)
            dispatched.append(time.perf_counter() - start)
            assert done.exit_code == 0, done
            spec = msgspec.structs.replace(run.spec, session_id=f"direct-{i}")
            os.makedirs(spec.runner_state_dirs[0], exist_ok=True)
            start = time.perf_counter()
            handle = manager.launch(spec, deny_create_globs=STANDARD_DENY_CREATE_GLOBS)
            plain = await run_collect(handle, ["true"], cwd=wt.path)
            await manager.destroy(spec.session_id)
            direct.append(time.perf_counter() - start)
            shutil.rmtree(spec.runner_state_dirs[0])
            assert plain.exit_code == 0
    finally:
        await service.aclose()
        await manager.aclose()
        worktrees.remove_all()
    d, p = statistics.median(dispatched), statistics.median(direct)
    print(f"dispatch run (open, harness `true`, close), {rounds} rounds (medians):")
    print(f"  dispatch {d * 1000:8.1f} ms   manager launch+exec {p * 1000:8.1f} ms   "
          f"{d / p:6.3f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="ccs-bench-dispatch-", dir="/tmp")
    try:
        repo = make_checkout(root, args.files)
        bench_worktrees(root, repo, args.rounds)
        asyncio.run(bench_dispatch(root, repo, args.rounds))
    finally:
        # Whatever failed, no worktree mount outlives the run (rmtree would reach through one
        # into the checkout and could not remove its mount point).
        for point in mounted_under(root):
            _umount(point)
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
