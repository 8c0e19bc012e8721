"""The spec model: what a caller asks for, with the reference page's exact JSON names.

JSON uses camelCase (`sessionId`, `bindMounts`, ...); Python attributes are snake_case. Unknown
fields are rejected. Models are frozen: a spec is a value, never edited in place.
"""

from __future__ import annotations

import enum
import posixpath
from typing import Annotated, Any, ClassVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from cc_server.errors import BadSpec

__all__ = [
    "AbsolutePath",
    "AgentCapabilities",
    "Mode",
    "SandboxBackend",
    "SandboxBindMount",
    "SandboxSpec",
    "parse_spec",
]


def _check_absolute(value: str) -> str:
    """Accept only absolute, normalised POSIX paths with no control characters."""
    if not value.startswith("/"):
        raise ValueError(f"path must be absolute, got {value!r}")
    if "\x00" in value:
        raise ValueError("path must not contain a NUL byte")
    parts = value.split("/")
    if ".." in parts or "." in parts:
        raise ValueError(f"path must not contain '.' or '..' components, got {value!r}")
    normalised = posixpath.normpath(value)
    if normalised.startswith("//"):
        normalised = normalised[1:]
    if normalised != value.rstrip("/") and value != "/":
        raise ValueError(f"path must be normalised (no repeated '/'), got {value!r}")
    return normalised


AbsolutePath = Annotated[str, AfterValidator(_check_absolute)]


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_enum_values=False,
    )


class Mode(enum.StrEnum):
    """Carves the filesystem write rules."""

    CHAT = "chat"  # bind mounts keep their own read/write flag
    REVIEW = "review"  # every bind mount read-only
    PLAN = "plan"  # every bind mount read-only
    ORCHESTRATE = "orchestrate"  # every bind mount read-only

    @property
    def binds_writable(self) -> bool:
        """Whether bind mounts may be writable in this mode."""
        return self is Mode.CHAT


class SandboxBackend(enum.StrEnum):
    """Which isolation runs the command."""

    MICROVM = "microvm"  # a VM with its own kernel
    NATIVE = "native"  # Seatbelt on macOS, bubblewrap on Linux
    NONE = "none"  # no isolation: runs on the host

    @classmethod
    def from_name(cls, name: str | None) -> SandboxBackend:
        """Map a stored value to a backend: null or unrecognised is `none`, "docker" is `native`."""
        if name is None:
            return cls.NONE
        if name == "docker":
            return cls.NATIVE
        try:
            return cls(name)
        except ValueError:
            return cls.NONE


class AgentCapabilities(_Model):
    """What the agent may do; derives the network decision and the GitHub egress domains."""

    can_use_network: bool = Field(True, description="Outbound network through the proxies")
    can_call_github_api: bool = Field(
        False,
        # The reference page spells it canCallGitHubApi; to_camel would give canCallGithubApi.
        # Not `alias=`, so type checkers keep the Python name as the keyword.
        validation_alias="canCallGitHubApi",
        serialization_alias="canCallGitHubApi",
        description="GitHub API domains join the allowlist",
    )
    can_push: bool = Field(False, description="git push; earns the GitHub domains too")
    can_call_ticketing: bool = Field(False, description="Ticketing-provider API access")

    SAFE_DEFAULT: ClassVar[AgentCapabilities]

    @classmethod
    def safe_default(cls) -> AgentCapabilities:
        """Network through the baseline allowlist only; no GitHub, push or ticketing."""
        return cls.SAFE_DEFAULT

    @property
    def earns_github(self) -> bool:
        """GitHub domains are allowed when the agent can call the API or push."""
        return self.can_call_github_api or self.can_push


AgentCapabilities.SAFE_DEFAULT = AgentCapabilities()


class SandboxBindMount(_Model):
    """One host directory or file made visible inside the sandbox."""

    host_path: AbsolutePath = Field(description="Absolute path on the host")
    guest_path: AbsolutePath | None = Field(
        None, description="Path inside the sandbox; defaults to hostPath (native requires equal)"
    )
    read_only: bool = Field(False, description="Mount read-only when true")

    @field_validator("host_path")
    @classmethod
    def _not_root(cls, value: str) -> str:
        if value == "/":
            raise ValueError(
                "binding the host root '/' exposes the whole host; bind the directories the "
                "command needs instead"
            )
        return value

    @property
    def guest(self) -> str:
        """The path inside the sandbox."""
        return self.guest_path if self.guest_path is not None else self.host_path


class SandboxSpec(_Model):
    """What SandboxPort.launch is asked to run under."""

    session_id: str = Field(min_length=1, max_length=256, description="Stable session id")
    workspace_id: str = Field(min_length=1, max_length=256, description="Owning workspace id")
    agent_id: str | None = Field(None, description="Agent bound to the sandbox, if any")
    bind_mounts: tuple[SandboxBindMount, ...] = Field(
        (), description="Host->guest mounts; the sandbox sees only these host paths"
    )
    network_enabled: bool = Field(True, description="Combined with the network capability")
    egress_allowlist: tuple[str, ...] = Field((), description="Extra allowed egress domains")
    guest_workdir: AbsolutePath | None = Field(None, description="Default working directory")
    mode: Mode = Field(Mode.CHAT, description="Carves the filesystem write rules")
    capabilities: AgentCapabilities = Field(
        default_factory=AgentCapabilities.safe_default, description="What the agent may do"
    )
    protected_paths: tuple[AbsolutePath, ...] = Field(
        (), description="Host paths never writable inside the sandbox, in any mode"
    )
    runner_state_dirs: tuple[AbsolutePath, ...] = Field(
        (), description="Runner state directories, writable in every mode"
    )
    exec_grant_roots: tuple[AbsolutePath, ...] = Field(
        (), description="Trees that re-open the writable-dir exec block (macOS only)"
    )

    @field_validator("session_id", "workspace_id")
    @classmethod
    def _printable_id(cls, value: str) -> str:
        if not value.isprintable() or "/" in value:
            raise ValueError("ids must be printable and must not contain '/'")
        return value

    @model_validator(mode="after")
    def _unique_guest_paths(self) -> SandboxSpec:
        seen: set[str] = set()
        for mount in self.bind_mounts:
            if mount.guest in seen:
                raise ValueError(f"two bind mounts share the guest path {mount.guest!r}")
            seen.add(mount.guest)
        return self

    @property
    def network_allowed(self) -> bool:
        """networkEnabled combined with the agent's network capability."""
        return self.network_enabled and self.capabilities.can_use_network


def parse_spec(data: Any) -> SandboxSpec:
    """Validate JSON-shaped data (a dict, or a JSON string) into a SandboxSpec.

    Raises:
        BadSpec: the data is malformed, has an unknown field, or a path is not absolute. The
            message names every offending field by its JSON path.
    """
    try:
        if isinstance(data, str | bytes):
            return SandboxSpec.model_validate_json(data)
        return SandboxSpec.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "<spec>"
            message = err["msg"]
            if err["type"] == "extra_forbidden":
                message = "unknown field (check the spelling; fields are camelCase)"
            problems.append(f"{where}: {message}")
        raise BadSpec(
            "invalid SandboxSpec: " + "; ".join(problems),
            fix="correct the fields named above",
        ) from None
