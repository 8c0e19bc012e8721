"""The spec model: what a caller asks for, with the reference page's exact JSON names.

JSON uses camelCase (`sessionId`, `bindMounts`, ...); Python attributes are snake_case. Unknown
fields are rejected. Models are frozen: a spec is a value, never edited in place.

Built on msgspec: typed, frozen structs with camelCase renaming, unknown-field rejection and JSON
Schema generation, at a fraction of the import cost of the alternatives (the CLI pays it per run).
"""

from __future__ import annotations

import enum
import posixpath
import re
from typing import Annotated, Any, ClassVar

import msgspec

from cc_server.errors import BadSpec

__all__ = [
    "AgentCapabilities",
    "Mode",
    "SandboxBackend",
    "SandboxBindMount",
    "SandboxSpec",
    "check_absolute",
    "parse_spec",
    "spec_json_schema",
]

# JSON names the camelCase rule would spell differently from the reference page.
_JSON_NAME_OVERRIDES = {"can_call_github_api": "canCallGitHubApi"}


def _json_name(field: str) -> str:
    if field in _JSON_NAME_OVERRIDES:
        return _JSON_NAME_OVERRIDES[field]
    head, *rest = field.split("_")
    return head + "".join(part.title() for part in rest)


def check_absolute(value: str) -> str:
    """Accept only absolute, normalised POSIX paths without NUL; return the path.

    Raises:
        ValueError: the path is relative, has '.', '..' or repeated '/' components, or a NUL.
    """
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


MAX_ID_LENGTH = 256  # ids travel in URLs, logs and file names
_Id = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_ID_LENGTH, description="An identifier")
]


def _normalise(model: msgspec.Struct, name: str, value: object) -> None:
    """Store the normalised form of a validated field ('/a/' becomes '/a'), in __post_init__."""
    msgspec.structs.force_setattr(model, name, value)


def _checked(json_name: str, path: str) -> str:
    """check_absolute, with the field's JSON name leading the error message."""
    try:
        return check_absolute(path)
    except ValueError as exc:
        raise ValueError(f"{json_name}: {exc}") from None


class _Model(
    msgspec.Struct, rename=_json_name, forbid_unknown_fields=True, frozen=True, kw_only=True
):
    def to_json(self) -> dict[str, Any]:
        """The JSON-ready form, with the reference page's names."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


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


class AgentCapabilities(_Model, frozen=True):  # frozen restated for type checkers
    """What the agent may do; derives the network decision and the GitHub egress domains."""

    can_use_network: bool = True  # outbound network through the proxies
    can_call_github_api: bool = False  # GitHub API domains join the allowlist
    can_push: bool = False  # git push; earns the GitHub domains too
    can_call_ticketing: bool = False  # ticketing-provider API access

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


class SandboxBindMount(_Model, frozen=True):  # frozen restated for type checkers
    """One host directory or file made visible inside the sandbox."""

    host_path: str  # absolute path on the host
    guest_path: str | None = None  # path inside the sandbox; defaults to hostPath
    read_only: bool = False  # mount read-only when true
    # Commands may connect to Unix sockets a host process listens on below it (the credential
    # broker's own bind); without it only a socket bound inside the sandbox can be connected to.
    host_sockets: bool = False

    def __post_init__(self) -> None:
        _normalise(self, "host_path", _checked("hostPath", self.host_path))
        if self.guest_path is not None:
            _normalise(self, "guest_path", _checked("guestPath", self.guest_path))
        if self.host_path == "/":
            raise ValueError(
                "hostPath: binding the host root '/' exposes the whole host; bind the "
                "directories the command needs instead"
            )

    @property
    def guest(self) -> str:
        """The path inside the sandbox."""
        return self.guest_path if self.guest_path is not None else self.host_path


class SandboxSpec(_Model, frozen=True):  # frozen restated for type checkers
    """What SandboxPort.launch is asked to run under."""

    session_id: _Id  # stable session identifier (typically the space id)
    workspace_id: _Id  # owning workspace id
    agent_id: str | None = None  # agent bound to the sandbox, if any
    bind_mounts: tuple[SandboxBindMount, ...] = ()  # the sandbox sees only these host paths
    network_enabled: bool = True  # combined with the agent's network capability
    egress_allowlist: tuple[str, ...] = ()  # extra allowed egress domains
    guest_workdir: str | None = None  # default working directory inside the sandbox
    mode: Mode = Mode.CHAT  # carves the filesystem write rules
    capabilities: AgentCapabilities = msgspec.field(
        default_factory=AgentCapabilities.safe_default
    )  # derives the network decision and GitHub egress
    protected_paths: tuple[str, ...] = ()  # host paths never writable, in any mode
    runner_state_dirs: tuple[str, ...] = ()  # runner state directories, writable in every mode
    exec_grant_roots: tuple[str, ...] = ()  # trees re-opening the writable-dir exec block (macOS)

    def __post_init__(self) -> None:
        for name, value in (("sessionId", self.session_id), ("workspaceId", self.workspace_id)):
            if not 1 <= len(value) <= MAX_ID_LENGTH:
                raise ValueError(f"{name}: must be 1 to {MAX_ID_LENGTH} characters")
            if not value.isprintable() or "/" in value:
                raise ValueError(f"{name}: ids must be printable and must not contain '/'")
        for name in ("protected_paths", "runner_state_dirs", "exec_grant_roots"):
            json_name = _json_name(name)
            _normalise(
                self,
                name,
                tuple(
                    _checked(f"{json_name}[{i}]", path)
                    for i, path in enumerate(getattr(self, name))
                ),
            )
        if self.guest_workdir is not None:
            _normalise(self, "guest_workdir", _checked("guestWorkdir", self.guest_workdir))
        seen: set[str] = set()
        for i, mount in enumerate(self.bind_mounts):
            if mount.guest in seen:
                raise ValueError(
                    f"bindMounts[{i}]: two bind mounts share the guest path {mount.guest!r}"
                )
            seen.add(mount.guest)

    @property
    def network_allowed(self) -> bool:
        """networkEnabled combined with the agent's network capability."""
        return self.network_enabled and self.capabilities.can_use_network


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<loc>[^`]*)`)?$", re.DOTALL)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`$")
_FIELD_FIRST = re.compile(r"^(?P<field>[A-Za-z]+(?:\[\d+\])?): (?P<rest>.*)$", re.DOTALL)


def _describe(error: msgspec.ValidationError) -> str:
    match = _AT.match(str(error))
    assert match is not None  # the pattern accepts every string
    message, where = match["msg"], (match["loc"] or "").lstrip(".")
    unknown = _UNKNOWN.match(message)
    field_first = _FIELD_FIRST.match(message)
    if unknown:
        where = f"{where}.{unknown['name']}" if where else unknown["name"]
        message = "unknown field (check the spelling; fields are camelCase)"
    elif field_first:  # raised in __post_init__: the struct's location plus the field's name
        where = f"{where}.{field_first['field']}" if where else field_first["field"]
        message = field_first["rest"]
    return f"{where or '<spec>'}: {message}"


def parse_spec(data: Any) -> SandboxSpec:
    """Validate JSON-shaped data (a dict, or a JSON string or bytes) into a SandboxSpec.

    Raises:
        BadSpec: the data is malformed, has an unknown field, or a path is not absolute. The
            message names the offending field by its JSON path.
    """
    try:
        if isinstance(data, str | bytes):
            return msgspec.json.decode(data, type=SandboxSpec)
        return msgspec.convert(data, SandboxSpec)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        detail = _describe(exc) if isinstance(exc, msgspec.ValidationError) else str(exc)
        raise BadSpec(
            f"invalid SandboxSpec: {detail}", fix="correct the field named above"
        ) from None


def spec_json_schema() -> dict[str, Any]:
    """The JSON Schema of SandboxSpec (for the API's OpenAPI document)."""
    schema: dict[str, Any] = msgspec.json.schema(SandboxSpec)
    return schema
