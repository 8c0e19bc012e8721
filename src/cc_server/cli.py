"""`cc-server probe | plan | run`: the command line over the library API."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from cc_server.backends.egress_bridge import HTTP_PROXY_PORT, SOCKS_PROXY_PORT
from cc_server.backends.plan import Command, EgressBridge, LaunchPlan
from cc_server.backends.probe import SANDBOX_EXEC_PATH, Mechanism, ProbeResult, probe
from cc_server.backends.runner import run_attached
from cc_server.backends.seatbelt import render_seatbelt_plan
from cc_server.cli_spec import (
    DEFAULT_DOTFILES,
    HOME_CHOICES,
    build_spec,
    command_argv,
    command_env,
)
from cc_server.cli_violations import ViolationPrinter, print_live
from cc_server.errors import BadSpec, CcServerError, ConfigError
from cc_server.policy import (
    HostFacts,
    Mode,
    Platform,
    SandboxBackend,
    compile_policy,
)
from cc_server.policy.paths import is_within
from cc_server.runtime.select import (
    EgressRoute,
    choose_backend,
    egress_route,
    planner_for,
    protected_patterns_for,
)

if TYPE_CHECKING:
    from cc_server.microvm.runtime import MicroVMRuntime
    from cc_server.runtime.events import SandboxEvent
    from cc_server.runtime.handle import Execution, SandboxHandle

__all__ = ["build_spec", "command_argv", "command_env", "main", "parser", "print_violations"]

CAPABILITIES = ("canUseNetwork", "canCallGitHubApi", "canPush", "canCallTicketing")
# Shown by `plan` where `run` puts the session's private proxy socket directory.
PLAN_SOCKET_DIR = "<session socket dir>"
# `plan --platform macos` off a Mac: the per-user temp dir and the proxies' loopback ports are the
# session's own at run time; these stand in for them.
PLAN_MACOS_TEMP_DIR = "/var/folders/<per-user>/T"
# macOS resolves these top-level names into /private (what the kernel matches rules against).
MACOS_PRIVATE_LINKS = ("/tmp", "/var", "/etc")
EXIT_USAGE = 2
STDIN_CHUNK_BYTES = 64 * 1024  # one read of the caller's stdin for a microVM command
EXIT_REFUSED = 125  # like `env`/`timeout`: the command itself never ran


def _bind(value: str) -> dict[str, Any]:
    parts = value.split(":")
    read_only = False
    if len(parts) > 1 and parts[-1] in ("ro", "rw"):
        read_only = parts.pop() == "ro"
    if len(parts) > 2:
        raise argparse.ArgumentTypeError(
            f"--bind {value!r}: a path containing ':' cannot be given here; use --spec FILE"
        )
    host = os.path.abspath(parts[0])
    out: dict[str, Any] = {"hostPath": host, "readOnly": read_only}
    if len(parts) == 2:
        out["guestPath"] = parts[1]
    return out


def _env_pair(value: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--env {value!r}: expected NAME=VALUE")
    return key, val


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--settings", metavar="FILE",
                   help="a TOML file of these options (keys are the flag names: bind = [...], "
                   "backend = ...); read after the per-user file "
                   "~/.config/cc-server/settings.toml; flags override both")
    p.add_argument(
        "--backend",
        choices=[b.value for b in SandboxBackend],
        help="backend to use; unspecified means native when the probe found one, else none",
    )
    p.add_argument("--mode", choices=[m.value for m in Mode], default=None)
    p.add_argument("--bind", type=_bind, action="append", default=[],
                   metavar="HOST[:GUEST][:ro]",
                   help="make a host path visible (repeatable); with none, the current "
                   "directory is bound writable")
    p.add_argument("--bind-cwd", action=argparse.BooleanOptionalAction, default=None,
                   help="bind the current directory writable when nothing else is bound "
                   "(default; refused in $HOME and /)")
    p.add_argument("--home", choices=HOME_CHOICES, default=None,
                   help="empty: a throw-away $HOME (default); dotfiles: the same, with a "
                   "read-only view of the --dotfile entries (git identity, toolchains); the "
                   "secret set (~/.ssh, ~/.aws, ...) stays masked in both")
    p.add_argument("--dotfile", action="append", default=[], metavar="NAME",
                   help="a file or directory under $HOME that --home dotfiles shows read-only "
                   f"(repeatable; default: {', '.join(DEFAULT_DOTFILES)})")
    p.add_argument("--protect", action="append", default=[], metavar="PATH",
                   help="a host path that must never be writable (repeatable)")
    p.add_argument("--runner-state", action="append", default=[], metavar="DIR",
                   help="a runner state directory, writable in every mode (repeatable)")
    p.add_argument("--workdir", help="working directory inside the sandbox (default: the current "
                   "directory when it is inside a bind, else the first bind)")
    p.add_argument("--deny-create", action="append", default=[], metavar="GLOB",
                   help="refuse creating files whose name matches GLOB (repeatable)")
    p.add_argument("--network", action=argparse.BooleanOptionalAction, default=None,
                   help="--no-network: networkEnabled false (the proxies still start and "
                   "refuse everything)")
    p.add_argument("--allow-domain", action="append", default=[], metavar="PATTERN[:PORT]",
                   help="add to the session's egress allowlist: host, *.domain, a.*.b or an IP, "
                   "each with an optional :PORT (pypi.org:443, [::1]:8080); repeatable")
    p.add_argument("--capability", action="append", default=[], choices=CAPABILITIES,
                   help="grant an agent capability (repeatable)")
    p.add_argument("--env", type=_env_pair, action="append", default=[], metavar="NAME=VALUE",
                   help="set a variable for the command (repeatable)")
    p.add_argument("--spec", metavar="FILE", help="a SandboxSpec JSON file; options add to it")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")


RUN_EXAMPLES = """\
examples:
  cc-server run -- make test                 the current directory, writable, is the workdir
  cc-server run --home dotfiles -- git commit -m wip
                                             ~/.gitconfig visible read-only: git knows you
  cc-server run --bind ~/src/app --bind ~/data:ro -- ./run.sh    ~/data read-only
  cc-server run --mode review --no-network -- pytest
                                             every bind read-only, no network at all
  cc-server run --allow-domain pypi.org --allow-domain '*.pythonhosted.org' -- pip install x
  cc-server run --backend microvm -- uname -r   the guest's own kernel, its own VM
  cc-server plan --settings team.toml -- make   the merged settings and the argv; runs nothing

the current directory is bound writable only when nothing else is bound; $HOME and / are refused
(cd into a project, or --bind what the command needs). The sandbox's $HOME is empty unless
--home dotfiles; the secret set (~/.ssh, ~/.aws, ~/.gnupg, ...) is masked whatever is bound.
"""


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cc-server", description=__doc__)
    sub = parser.add_subparsers(dest="verb", required=True)
    p_probe = sub.add_parser("probe", help="report which sandbox backend this host offers")
    p_probe.add_argument("--json", action="store_true", help="machine-readable output")
    p_probe.add_argument("--microvm", action="store_true",
                         help="also boot-test the microvm backend and say which accelerator "
                         "works, or why none (builds its guest image on first use)")
    p_plan = sub.add_parser("plan", help="print the launch plan `run` would execute")
    _add_run_options(p_plan)
    p_plan.add_argument("--json", action="store_true", help="machine-readable output")
    p_plan.add_argument("--platform", choices=["linux", "macos"],
                        help="plan as on this platform (default: this host's); runs nothing. "
                        "macos prints the Seatbelt profile and the sandbox-exec command line")
    p_run = sub.add_parser("run", help="run a command in a sandbox; exits with its code",
                           epilog=RUN_EXAMPLES,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_run_options(p_run)
    p_run.add_argument("--events", choices=["json"], help="stream events as JSON lines")
    p_run.add_argument("--timeout", type=float, metavar="SECONDS", help="kill after SECONDS")
    p_run.add_argument("--ask", action="store_true",
                       help="on a terminal: ask about each connection to a host the allowlist "
                       "does not name (once, session, deny; 30 s, then refused)")
    p_serve = sub.add_parser("serve", help="run the HTTP and WebSocket server")
    p_serve.add_argument("--host", default="127.0.0.1",
                         help="address to bind (non-loopback only with --tls-cert/--tls-key)")
    p_serve.add_argument("--port", type=int, default=8421,
                         help="port to bind; 0 picks a free one (logged on the listening line)")
    p_serve.add_argument("--sandbox", metavar="on|off",
                         help="wrap commands when the host offers a backend (default on; "
                         "overrides CC_SERVER_SANDBOX)")
    p_serve.add_argument("--token-file", metavar="PATH",
                         help="where to write the bearer token (default: a private runtime dir)")
    p_serve.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    p_serve.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate")
    p_serve.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    p_serve.add_argument("--dispatch-allow-domain", action="append", default=[],
                         metavar="PATTERN",
                         help="extend every dispatch run's baseline egress allowlist: host, "
                         "*.domain, a.*.b, an IP address (repeatable; adds to "
                         "CC_SERVER_DISPATCH_ALLOW_DOMAINS)")
    p_daemon = sub.add_parser(
        "daemon", help="the CLI daemon that serves `run` (started on first use; "
        "CC_SERVER_DAEMON=off runs without it)")
    p_daemon.add_argument("action", choices=["stop"], help="stop: exit once its commands are done")
    return parser


def _cmd_serve(args: argparse.Namespace) -> int:
    # Lazy import: the server (aiohttp) is paid for only by `serve`.
    from cc_server.server import ServerConfig, ServerConfigError, run_server

    try:
        config = ServerConfig.build(
            host=args.host, port=args.port, sandbox_flag=args.sandbox,
            token_file=args.token_file, log_json=args.log_json,
            tls_cert=args.tls_cert, tls_key=args.tls_key,
            dispatch_allow_domains=tuple(args.dispatch_allow_domain),
        )
    except ServerConfigError as exc:
        print(f"cc-server: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return run_server(config)


def _backend(args: argparse.Namespace, result: ProbeResult) -> SandboxBackend:
    requested = SandboxBackend(args.backend) if args.backend else None
    return choose_backend(result, requested, sandbox_on=True)


def _plan(
    args: argparse.Namespace,
    result: ProbeResult,
    host: HostFacts | None = None,
    temp_dir: str | None = None,
) -> LaunchPlan:
    """Compile, choose and plan exactly as the library does, without an event loop or proxies.

    `host` and `temp_dir` stand in for this host's facts (`plan --platform` on another OS)."""
    host = HostFacts.current() if host is None else host
    backend = _backend(args, result)
    spec = build_spec(args)
    policy = compile_policy(
        spec, host, deny_create_globs=args.deny_create,
        protected_patterns=protected_patterns_for(result)
        if backend is SandboxBackend.NATIVE else (),
    )  # fmt: skip
    bridge = None
    route = egress_route(backend, result)
    if route is not None:
        from cc_server.egress.resolver import allowlist_for  # lazy import: name tables

        allowlist_for(spec)  # a malformed allowlist entry fails here, as it would in `run`
        bridge = EgressBridge(socket_dir=PLAN_SOCKET_DIR)
        if route is EgressRoute.LOOPBACK:  # a Mac's sandbox reaches the proxies on loopback
            bridge = EgressBridge(socket_dir=PLAN_SOCKET_DIR, http_port=HTTP_PROXY_PORT,
                                  socks_port=SOCKS_PROXY_PORT)
    command = Command(argv=tuple(command_argv(args)), env=tuple(sorted(command_env(args).items())),
                      egress=bridge)
    return planner_for(backend, result, host, temp_dir=temp_dir).plan(policy, command)


def _macos_realpath(path: str) -> str:
    """This host's symlinks, then macOS's /tmp, /var and /etc -> /private/... ."""
    resolved = os.path.realpath(path)
    for link in MACOS_PRIVATE_LINKS:
        if is_within(resolved, link):
            return "/private" + resolved
    return resolved


def _as_platform(platform: str) -> tuple[ProbeResult, HostFacts | None, str | None]:
    """The probe, host facts and temp dir `plan --platform` uses: this host's when it is that
    platform; otherwise stand-ins built from this host's home and files. Nothing is run."""
    real = probe()
    if platform == "macos":
        if real.platform is Platform.MACOS:
            return real, None, None
        fake = ProbeResult(platform=Platform.MACOS, available=True, mechanism=Mechanism.SEATBELT,
                           tools={"sandbox-exec": SANDBOX_EXEC_PATH})
        current = HostFacts.current(Platform.MACOS)
        host = HostFacts(platform=Platform.MACOS, home=current.home, realpath=_macos_realpath,
                         exists=current.exists, is_dir=current.is_dir)
        return fake, host, PLAN_MACOS_TEMP_DIR
    if real.platform in (Platform.LINUX, Platform.WSL2):
        return real, None, None
    fake = ProbeResult(platform=Platform.LINUX, available=True, mechanism=Mechanism.BUBBLEWRAP,
                       tools={"bwrap": "/usr/bin/bwrap", "socat": "/usr/bin/socat"})
    return fake, HostFacts.current(Platform.LINUX), None


def _probe_microvm() -> dict[str, object]:
    import asyncio  # lazy imports: only `probe --microvm` boots a VM

    from cc_server.microvm.runtime import probe_runtime

    return asyncio.run(probe_runtime()).probe.to_json()


def _cmd_probe(args: argparse.Namespace) -> int:
    result = probe()
    microvm = _probe_microvm() if args.microvm else None
    if args.json:
        out = result.to_json()
        if microvm is not None:
            out["microvm"] = microvm
        print(json.dumps(out, indent=2))
    else:
        print(f"platform:  {result.platform}")
        print(f"available: {'yes' if result.available else 'no'}")
        if result.mechanism:
            print(f"mechanism: {result.mechanism}")
        if result.note:
            print(f"note:      {result.note}")
        if result.hint:
            print(f"hint:      {result.hint}")
        for name, path in sorted(result.tools.items()):
            print(f"tool:      {name} = {path}")
        if microvm is not None:
            accel = microvm["accelerator"]
            print(f"microvm:   {accel if microvm['available'] else 'unavailable'}: "
                  f"{microvm['reason']}")
            if microvm["fix"]:
                print(f"microvm fix: {microvm['fix']}")
    return 0


def _microvm_plan(args: argparse.Namespace) -> dict[str, Any]:
    """What `run --backend microvm` would set up: the guest's mount steps, shares and command.
    Nothing is probed or booted.

    Raises:
        BadSpec: the spec does not compile or its mounts do not fit a VM.
        BackendUnavailable: the policy needs create-time rules, which the guest does not enforce.
    """
    from cc_server.errors import BackendUnavailable
    from cc_server.microvm.mounts import plan_mounts

    policy = compile_policy(build_spec(args), HostFacts.current(),
                            deny_create_globs=args.deny_create)
    if policy.requires_create_rules:
        raise BackendUnavailable("the policy forbids creating files by name (create-time globs), "
                                 "which the microVM guest does not enforce",
                                 fix="request 'native' for this policy")
    mounts = plan_mounts(policy, is_dir=os.path.isdir, exists=os.path.lexists)
    return {
        "backend": "microvm", "argv": command_argv(args), "env": command_env(args),
        "cwd": policy.workdir or "/",
        "shares": [{"hostPath": sh.host_path, "readOnly": sh.read_only} for sh in mounts.shares],
        "guestMounts": [{"op": step.op.name.lower(), "guestPath": step.guest_path,
                         "tag": step.tag, "readOnly": step.read_only, "reason": step.reason}
                        for step in mounts.steps],
    }  # fmt: skip


def _render_microvm_plan(plan: Mapping[str, Any]) -> str:
    lines = ["backend: microvm (the command runs on the guest's kernel; no host argv)",
             f"cwd: {plan['cwd']}", "env:"]
    lines += [f"  {k}={shlex.quote(v)}" for k, v in sorted(plan["env"].items())]
    lines += ["argv:", "  " + shlex.join(plan["argv"]), "shares (9p, one slot each):"]
    lines += [f"  {sh['hostPath']}{' (read-only)' if sh['readOnly'] else ''}"
              for sh in plan["shares"]]
    lines.append("guest mounts, in order:")
    lines += [f"  {m['op']} {m['guestPath']}{' ' + m['tag'] if m['tag'] else ''}"
              f"{' ro' if m['readOnly'] else ''}{'  # ' + m['reason'] if m['reason'] else ''}"
              for m in plan["guestMounts"]]
    return "\n".join(lines)


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.backend == SandboxBackend.MICROVM:
        plan_json: dict[str, Any] = _microvm_plan(args)
        text = _render_microvm_plan(plan_json)
    elif args.platform is None:
        plan = _plan(args, probe())
    else:
        result, host, temp_dir = _as_platform(args.platform)
        plan = _plan(args, result, host, temp_dir)
    from cc_server.settings import merged_settings, render_settings

    settings = merged_settings(args, _settings_keys(parser(), "plan"))
    sources = [*args.settings_sources, "flags"]
    if args.backend != SandboxBackend.MICROVM:
        plan_json = plan.to_json()
    if args.json:
        out = {**plan_json, "settings": {"sources": sources, "merged": settings}}
        print(json.dumps(out, indent=2))
        return 0
    if args.backend == SandboxBackend.MICROVM:
        print(text)
    elif plan.argv and plan.argv[0] == SANDBOX_EXEC_PATH:
        print(render_seatbelt_plan(plan))
        if args.platform == "macos" and temp_dir is not None:
            print("note: planned off a Mac: the temp dir and the proxy ports are stand-ins for "
                  "the session's own")
    else:
        print(plan.render())
    print(f"settings (from {', '.join(sources)}):")
    print("\n".join(f"  {line}" for line in render_settings(settings).splitlines()) or "  (none)")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    result = probe()
    if args.backend == SandboxBackend.MICROVM:  # probed here, on request: the boot test costs
        import asyncio

        return asyncio.run(_run_streaming(args, result))
    if args.events is None and args.timeout is None and not args.ask and _backend(
        args, result
    ) is not SandboxBackend.NATIVE:
        return run_attached(_plan(args, result))  # no proxies to run: no event loop needed
    import asyncio  # lazy import (the proxies and the event streams need the event loop)

    return asyncio.run(_run_streaming(args, result))


async def _run_streaming(args: argparse.Namespace, result: ProbeResult) -> int:
    # Lazy imports: only the streaming path pays for the runtime and its event loop.
    import asyncio

    from cc_server.cli_ask import open_asking
    from cc_server.runtime.events import EventType
    from cc_server.runtime.port import SandboxManager

    manager = SandboxManager(probe_result=result, host=HostFacts.current())
    requested = SandboxBackend(args.backend) if args.backend else None
    if requested is SandboxBackend.MICROVM:
        manager.use_microvm(await probe_microvm_runtime(sys.stderr))
    handle = manager.launch(build_spec(args), backend=requested, deny_create_globs=args.deny_create)
    stream = args.events == "json"
    relay = not stream and requested is SandboxBackend.MICROVM  # the guest's stdio: relayed
    live = print_live(handle, sys.stderr)  # each violation on stderr as it happens
    try:
        opened = handle.open_exec(command_argv(args), env=command_env(args),
                                  inherit_stdio=not stream and not relay,
                                  interactive_stdin=relay, timeout_s=args.timeout)
        async with (open_asking(args.ask, handle, sys.stderr) as prompter, opened as execution,
                    asyncio.TaskGroup() as tg):
            stdin = tg.create_task(pump_stdin(execution, sys.stdin.fileno()), name="stdin") \
                if relay else None
            async for event in execution:
                if prompter is not None and event.request is not None:
                    prompter.offer(event.request)
                if stream:
                    sys.stdout.write(json.dumps(event.to_json()) + "\n")
                    sys.stdout.flush()
                elif event.type is EventType.KILLED:
                    print(f"cc-server: command killed ({event.reason})", file=sys.stderr)
                elif relay:
                    await write_output(event, sys.stdout.fileno(), sys.stderr.fileno())
            if stdin is not None:
                stdin.cancel()
        live.rest(handle)
        return await execution.wait()
    finally:
        await manager.aclose()


async def write_output(event: SandboxEvent, stdout_fd: int, stderr_fd: int) -> None:
    """A stdout or stderr event's bytes to these descriptors (a microVM command's stdio is the
    guest's: it cannot inherit the caller's, so its output is relayed); other events: nothing."""
    import asyncio

    from cc_server.runtime.events import EventType

    fd = {EventType.STDOUT: stdout_fd, EventType.STDERR: stderr_fd}.get(event.type)
    if fd is not None and event.data:
        await asyncio.to_thread(_write_all, fd, event.data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


async def relay_stdio(execution: Execution, stdio: tuple[int, int, int]) -> None:
    """A microVM command's stdio through these descriptors: stdin pumped in (pump_stdin), every
    output event written out (write_output), until the command ends."""
    import asyncio

    async with asyncio.TaskGroup() as tg:
        stdin = tg.create_task(pump_stdin(execution, stdio[0]), name="stdin")
        async for event in execution:
            await write_output(event, stdio[1], stdio[2])
        stdin.cancel()


async def pump_stdin(execution: Execution, fd: int) -> None:
    """The caller's stdin to the command until its EOF, then EOF to the command. A pipe or
    terminal is read when readable (the descriptor is shared, so it is never set non-blocking);
    a regular file or /dev/null, which the loop cannot watch, never blocks a read."""
    import asyncio

    from cc_server.errors import CcServerError

    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    try:
        loop.add_reader(fd, readable.set)
        watched = True
    except (OSError, ValueError):
        watched = False
    try:
        while True:
            if watched:
                await readable.wait()
                readable.clear()
            try:
                data = os.read(fd, STDIN_CHUNK_BYTES)
            except BlockingIOError:
                continue
            if not data:
                break
            await execution.write_stdin(data)
        execution.close_stdin()
    except (CcServerError, OSError):
        return  # the command is gone, or stdin closed: nothing more to pass on
    finally:
        if watched:
            loop.remove_reader(fd)


async def probe_microvm_runtime(progress_to: TextIO) -> MicroVMRuntime:
    """This host's microVM runtime, the image build of its first use shown on `progress_to`.
    The image and the booted snapshot are kept on disk, so later runs restore, never boot."""
    from cc_server.microvm.image import progress_bar
    from cc_server.microvm.runtime import probe_runtime

    return await probe_runtime(progress=progress_bar(progress_to))


def print_violations(handle: SandboxHandle, file: TextIO) -> None:
    """One line per violation of the run: its reason and the fix that applies
    (`cli_violations`)."""
    ViolationPrinter(file).rest(handle)


def _cmd_daemon(args: argparse.Namespace) -> int:
    from cc_server.cli_socket import stop_daemon  # lazy import: only this verb needs it

    stopped = stop_daemon()
    print("cc-server: the CLI daemon is stopping" if stopped else "cc-server: no CLI daemon runs")
    return 0


def parse_args(
    argv: Sequence[str] | None, top: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """The command line, with `run` and `plan` options filled from the settings files (the
    per-user file, then `--settings FILE`; see cc_server.settings). `top` is `parser()`, made
    once by a caller that parses many command lines (the CLI daemon); parsing leaves it as is.

    Raises:
        BadSpec: a settings file is unreadable, not TOML, or holds an unknown key or bad value.
        SystemExit: argparse's usage errors and `--help`.
    """
    top = parser() if top is None else top
    args = top.parse_args(argv)
    if args.verb not in ("run", "plan"):
        return args
    from cc_server.settings import apply_settings, default_settings_path, load_settings

    keys = _settings_keys(top, args.verb)
    layers = [load_settings(default_settings_path(), keys, required=False)]
    if args.settings:
        layers.append(load_settings(args.settings, keys))
    args.settings_sources = [layer.source for layer in layers if layer is not None]
    return apply_settings(args, [layer for layer in layers if layer is not None], keys)


def _settings_keys(top: argparse.ArgumentParser, verb: str) -> dict[str, argparse.Action]:
    from cc_server.settings import settings_keys

    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return settings_keys(sub.choices[verb])


def exit_code_for(exc: CcServerError) -> int:
    """The exit code of a run refused with `exc`: usage for the caller's or the operator's
    mistake (BadSpec, ConfigError; the user is both here), else EXIT_REFUSED."""
    return EXIT_USAGE if isinstance(exc, BadSpec | ConfigError) else EXIT_REFUSED


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `cc-server` console script."""
    try:
        args = parse_args(argv)
    except BadSpec as exc:
        print(f"cc-server: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.verb == "probe":
            return _cmd_probe(args)
        if args.verb == "plan":
            return _cmd_plan(args)
        if args.verb == "serve":
            return _cmd_serve(args)
        if args.verb == "daemon":
            return _cmd_daemon(args)
        return _cmd_run(args)
    except CcServerError as exc:
        print(f"cc-server: {type(exc).__name__}: {exc}", file=sys.stderr)
        return exit_code_for(exc)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 141  # like a shell: our reader went away (e.g. `cc-server plan | head`)


if __name__ == "__main__":
    sys.exit(main())
