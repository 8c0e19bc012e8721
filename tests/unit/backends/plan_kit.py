"""What the bubblewrap plan tests share: a host with a fixed filesystem, one writable bind at
/work, made-up tool paths and seccomp filter bytes."""

from __future__ import annotations

from cc_server.backends.bubblewrap import CreateRuleTools
from cc_server.policy import CompiledPolicy, HostFacts, Platform, compile_policy, parse_spec

BWRAP = "/usr/bin/bwrap"
TOOLS = CreateRuleTools(
    launcher="/opt/cc/cc-create-launcher", library="/opt/cc/libcc-create-supervisor.so"
)
FAKE_BPF = b"\x06\x00\x00\x00\x00\x00\xff\x7f"  # RET ALLOW
FAKE_RULES_BPF = b"\x06\x00\x00\x00\x00\x00\xc0\x7f"  # RET USER_NOTIF


def fake_host(existing: tuple[str, ...] = ()) -> HostFacts:
    """A Linux host where /usr, /etc, /home/dev, /work and `existing` exist, all directories."""
    return HostFacts(
        platform=Platform.LINUX,
        home="/home/dev",
        realpath=lambda p: p,
        exists=lambda p: p in ("/usr", "/etc", "/home/dev", "/work", *existing),
        is_dir=lambda p: True,
        server_is_root=False,
    )


def work_policy(globs: tuple[str, ...] = ()) -> CompiledPolicy:
    """A chat session with /work bound writable, and `globs` as its create-time rules."""
    spec = parse_spec(
        {"sessionId": "s", "workspaceId": "w", "bindMounts": [{"hostPath": "/work"}]}
    )
    return compile_policy(spec, fake_host(), deny_create_globs=globs)
