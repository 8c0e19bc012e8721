"""The policy model: specs, modes, capabilities, backend names, path sets and `compile_policy`.

Pure: nothing here starts a process or writes a file.
"""

from cc_server.policy.compiler import (
    CompiledPolicy,
    Mount,
    MountKind,
    PathRule,
    compile_policy,
    spellings,
)
from cc_server.policy.host import HostFacts, Platform, detect_platform
from cc_server.policy.paths import PROTECTED_PATTERN_NAMES, STANDARD_DENY_CREATE_GLOBS
from cc_server.policy.spec import (
    AgentCapabilities,
    Mode,
    SandboxBackend,
    SandboxBindMount,
    SandboxSpec,
    parse_spec,
)

__all__ = [
    "PROTECTED_PATTERN_NAMES",
    "STANDARD_DENY_CREATE_GLOBS",
    "AgentCapabilities",
    "CompiledPolicy",
    "HostFacts",
    "Mode",
    "Mount",
    "MountKind",
    "PathRule",
    "Platform",
    "SandboxBackend",
    "SandboxBindMount",
    "SandboxSpec",
    "compile_policy",
    "detect_platform",
    "parse_spec",
    "spellings",
]
