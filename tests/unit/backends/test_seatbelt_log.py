"""The `log stream` parser on recorded lines, written from the documented shape of the kernel's
Sandbox messages ("Sandbox: <process>(<pid>) deny(1) <operation> <target>", the rule's message on
the next line, "N duplicate reports for ..."), in the ndjson and compact styles of `log(1)`.

No Mac is needed: these are the inputs a Mac would produce. Whether a given macOS release still
writes exactly this is on docs/macos.md's list of things only a Mac can confirm.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cc_server.backends.seatbelt import message_for
from cc_server.backends.seatbelt_log import (
    LOG_PATH,
    MAX_LINE_CHARS,
    SeatbeltDenial,
    SeatbeltLogParser,
    log_stream_argv,
    watch_denials,
)
from cc_server.runtime.events import SandboxViolation

TAG = "6f4fb177cf99"
OTHER = "0123456789ab"
KERNEL_SENDER = "/System/Library/Extensions/Sandbox.kext/Contents/MacOS/Sandbox"


def ndjson(message: str, *, pid: int = 0, image: str = "/kernel", **extra: object) -> str:
    record: dict[str, object] = {
        "timestamp": "2026-11-30 10:30:45.123456+0000",
        "messageType": "Error",
        "eventType": "logEvent",
        "processID": pid,
        "processImagePath": image,
        "senderImagePath": KERNEL_SENDER,
        "subsystem": "",
        "category": "",
        "eventMessage": message,
    }
    record.update(extra)
    return json.dumps(record)


def kernel(body: str, tag: str | None = TAG) -> str:
    return body if tag is None else f"{body}\n{message_for(tag)}"


def parse_all(lines: list[str], tag: str = TAG, **kwargs: object) -> list[SeatbeltDenial]:
    parser = SeatbeltLogParser(session_tag=tag, **kwargs)  # type: ignore[arg-type]
    out: list[SeatbeltDenial] = []
    for line in lines:
        out.extend(parser.feed(line))
    out.extend(parser.flush())
    return out


# --- ndjson: what log_stream_argv asks for --------------------------------------------------------


def test_a_read_denial_of_the_session_becomes_a_denial() -> None:
    line = ndjson(kernel("Sandbox: cat(4242) deny(1) file-read-data /Users/dev/.ssh/id_ed25519"))
    [denial] = parse_all([line])
    assert denial == SeatbeltDenial(
        action="file-read-data",
        target="/Users/dev/.ssh/id_ed25519",
        suggested_capability=None,
        raw=line,
        process="cat",
        pid=4242,
    )


@pytest.mark.parametrize(
    ("body", "action", "target"),
    [
        ("Sandbox: touch(81) deny(1) file-write-create /private/tmp/work/.env",
         "file-write-create", "/private/tmp/work/.env"),
        ("Sandbox: mv(82) deny(1) file-write-unlink /private/tmp/work/.git",
         "file-write-unlink", "/private/tmp/work/.git"),
        ("Sandbox: bash(83) deny(1) process-exec* /private/tmp/work/a.out",
         "process-exec*", "/private/tmp/work/a.out"),
        ("Sandbox: zsh(84) deny(1) process-exec /usr/bin/osascript",
         "process-exec", "/usr/bin/osascript"),
        ("Sandbox: curl(85) deny(1) network-outbound 93.184.216.34:443",
         "network-outbound", "93.184.216.34:443"),
        ("Sandbox: ssh(86) deny(1) network-outbound /private/var/run/ssh-agent.sock",
         "network-outbound", "/private/var/run/ssh-agent.sock"),
        ("Sandbox: python3.13(87) deny(1) file-read-data /Users/dev/My Folder/secret.txt",
         "file-read-data", "/Users/dev/My Folder/secret.txt"),
        ("3 duplicate reports for Sandbox: node(88) deny(1) file-write-data /Users/dev/.zshrc",
         "file-write-data", "/Users/dev/.zshrc"),
        ("Sandbox: Python Helper(89) deny(1) appleevent-send com.apple.Terminal",
         "appleevent-send", "com.apple.Terminal"),
        ("Sandbox: ln(90) deny(1) file-link", "file-link", ""),
        ("Sandbox: git(91) deny file-write-data /Users/dev/.gitconfig",
         "file-write-data", "/Users/dev/.gitconfig"),
    ],
)
def test_the_verb_and_target_of_each_denial_shape(body: str, action: str, target: str) -> None:
    [denial] = parse_all([ndjson(kernel(body))])
    assert (denial.action, denial.target) == (action, target)


def test_lines_of_other_sessions_other_sandboxes_and_no_message_are_ignored() -> None:
    body = "Sandbox: cat(4242) deny(1) file-read-data /Users/dev/.ssh/id_rsa"
    lines = [
        ndjson(kernel(body, OTHER)),  # another cc-server session
        ndjson(body),  # an App Sandbox app: no message at all
        ndjson(kernel(body, TAG + "0")),  # a longer tag that merely starts with ours
        ndjson(kernel(body, TAG)[:-1]),  # a truncated tag
        ndjson(f"{body}\nsome-other-message"),
        ndjson("Sandbox: cat(4242) allow(0) file-read-data /x\n" + message_for(TAG)),
        ndjson(kernel("kernel: unrelated message")),
    ]
    assert parse_all(lines) == []


def test_only_the_kernel_and_sandboxd_are_believed() -> None:
    body = "Sandbox: cat(4242) deny(1) file-read-data /Users/dev/.ssh/id_rsa"
    forged = [
        ndjson(kernel(body), pid=4242, image="/private/tmp/work/a.out"),  # `logger` from inside
        ndjson(kernel(body), pid=1, image="/sbin/launchd"),
        ndjson(kernel(body), pid="0", image="/bin/x"),  # not the kernel's numeric pid
        ndjson(kernel(body), pid=4242, image="/private/tmp/usr/libexec/sandboxd"),
    ]
    assert parse_all(forged) == []
    [denial] = parse_all([ndjson(kernel(body), pid=171, image="/usr/libexec/sandboxd")])
    assert denial.target == "/Users/dev/.ssh/id_rsa"


def test_a_crafted_file_name_cannot_attribute_a_denial_to_another_session() -> None:
    # The agent of session TAG creates a file whose name ends with session OTHER's message: the
    # kernel appends TAG's message after the path, so only TAG's parser takes the line.
    path = f"/private/tmp/work/x\n{message_for(OTHER)}"
    line = ndjson(kernel(f"Sandbox: touch(77) deny(1) file-write-create {path}"))
    assert parse_all([line], tag=OTHER) == []
    [denial] = parse_all([line], tag=TAG)
    assert denial.target == path


def test_a_network_denial_suggests_the_capability_that_would_allow_it() -> None:
    asked: list[str] = []

    def suggest(host: str) -> str | None:
        asked.append(host)
        return "canCallGitHubApi" if host == "140.82.112.3" else None

    lines = [
        ndjson(kernel("Sandbox: gh(5) deny(1) network-outbound 140.82.112.3:443")),
        ndjson(kernel("Sandbox: curl(6) deny(1) network-outbound [2606:4700::6810:84e5]:443")),
        ndjson(kernel("Sandbox: curl(7) deny(1) network-outbound *:443")),
        ndjson(kernel("Sandbox: ssh(8) deny(1) network-outbound /private/var/run/agent.sock")),
        ndjson(kernel("Sandbox: cat(9) deny(1) file-read-data /Users/dev/.netrc")),
    ]
    denials = parse_all(lines, suggest=suggest)
    assert [d.suggested_capability for d in denials] == ["canCallGitHubApi", None, None, None,
                                                         None]
    assert asked == ["140.82.112.3", "2606:4700::6810:84e5"]


def test_a_failing_suggestion_never_costs_the_denial() -> None:
    def suggest(host: str) -> str | None:
        raise RuntimeError("resolver tables missing")

    line = ndjson(kernel("Sandbox: gh(5) deny(1) network-outbound 140.82.112.3:443"))
    [denial] = parse_all([line], suggest=suggest)
    assert denial.suggested_capability is None


def test_noise_and_garbage_are_ignored() -> None:
    lines = [
        'Filtering the log data using "processID == 0 AND eventMessage CONTAINS \\"cc-x\\""',
        "{not json",
        "[1, 2, 3]",
        json.dumps({"eventMessage": 5, "processID": 0}),
        json.dumps({"processID": 0}),
        "",
        "{" + "x" * (MAX_LINE_CHARS + 1),
    ]
    assert parse_all(lines) == []


def test_bytes_and_line_breaks_are_accepted() -> None:
    line = ndjson(kernel("Sandbox: cat(1) deny(1) file-read-data /Users/dev/.aws/credentials"))
    [denial] = parse_all([(line + "\r\n").encode()])  # type: ignore[list-item]
    assert denial.target == "/Users/dev/.aws/credentials"


def test_a_denial_maps_one_to_one_onto_the_spec_violation() -> None:
    line = ndjson(kernel("Sandbox: curl(3) deny(1) network-outbound 140.82.112.3:443"))
    [denial] = parse_all([line], suggest=lambda host: "canCallGitHubApi")
    violation = SandboxViolation(action=denial.action, target=denial.target,
                                 suggested_capability=denial.suggested_capability, raw=denial.raw)
    assert violation.to_json() == {
        "action": "network-outbound",
        "target": "140.82.112.3:443",
        "suggestedCapability": "canCallGitHubApi",
        "raw": line,
    }


# --- compact: recorded logs -----------------------------------------------------------------------

COMPACT = [
    "Filtering the log data using \"eventMessage CONTAINS 'Sandbox'\"",
    "Timestamp               Ty Process[PID:TID]",
    "2026-11-30 10:30:45.123 E  kernel[0:2f3a] (Sandbox) Sandbox: cat(4242) deny(1) "
    "file-read-data /Users/dev/.ssh/id_ed25519",
    message_for(TAG),
    "2026-11-30 10:30:45.200 E  kernel[0:2f3a] (Sandbox) Sandbox: Safari(901) deny(1) "
    "file-read-data /Users/dev/Documents/x.pdf",
    "2026-11-30 10:30:45.300 E  kernel[0:2f3a] (Sandbox) Sandbox: bash(4243) deny(1) "
    "file-write-create /private/tmp/work/.env",
    message_for(OTHER),
    "2026-11-30 10:30:45.400 Df logger[4244:1a] Sandbox: cat(4244) deny(1) file-read-data /fake",
    message_for(TAG),
    "2026-11-30 10:30:45.500 E  kernel[0:2f3a] (Sandbox) Sandbox: git(4245) deny(1) "
    "file-write-data /private/tmp/work/.git/hooks/pre-commit",
    message_for(TAG),
]


def test_compact_style_keeps_the_sessions_kernel_denials_only() -> None:
    denials = parse_all(COMPACT)
    assert [(d.process, d.action, d.target) for d in denials] == [
        ("cat", "file-read-data", "/Users/dev/.ssh/id_ed25519"),
        ("git", "file-write-data", "/private/tmp/work/.git/hooks/pre-commit"),
    ]
    assert denials[0].raw == "\n".join(COMPACT[2:4])


def test_compact_style_reports_a_message_when_the_next_one_starts() -> None:
    parser = SeatbeltLogParser(session_tag=TAG)
    assert parser.feed(COMPACT[2]) == []
    assert parser.feed(COMPACT[3]) == []
    [denial] = parser.feed(COMPACT[4])
    assert denial.process == "cat"
    assert parser.flush() == []  # Safari's line: not ours


def test_a_blank_line_ends_a_compact_message_and_runaway_messages_are_dropped() -> None:
    parser = SeatbeltLogParser(session_tag=TAG)
    parser.feed(COMPACT[2])
    parser.feed(COMPACT[3])
    assert len(parser.feed("")) == 1
    parser.feed(COMPACT[2])
    for _ in range(200):
        parser.feed("continuation")
    assert parser.flush() == []


# --- the argv, the watcher, and the parser under fuzz ---------------------------------------------


def test_log_stream_argv_asks_the_kernel_for_the_session_by_absolute_path() -> None:
    argv = log_stream_argv(TAG)
    assert argv[0] == LOG_PATH == "/usr/bin/log"
    assert argv[1:5] == ("stream", "--style", "ndjson", "--predicate")
    assert f'CONTAINS "cc-{TAG}"' in argv[5]
    assert "processID == 0" in argv[5]


@pytest.mark.parametrize("tag", ["", 'x" OR 1 == 1 OR "', "UPPER", "a b"])
def test_a_malformed_tag_is_refused(tag: str) -> None:
    with pytest.raises(ValueError):
        log_stream_argv(tag)
    with pytest.raises(ValueError):
        SeatbeltLogParser(session_tag=tag)


async def test_watch_denials_reports_each_denial_until_the_stream_ends() -> None:
    async def lines() -> AsyncIterator[str]:
        for line in COMPACT:
            yield line

    seen: list[SeatbeltDenial] = []
    await watch_denials(lines(), SeatbeltLogParser(session_tag=TAG), seen.append)
    assert [d.process for d in seen] == ["cat", "git"]


@given(st.lists(st.one_of(st.text(max_size=300), st.binary(max_size=300)), max_size=30))
def test_any_input_never_raises(lines: list[str | bytes]) -> None:
    parser = SeatbeltLogParser(session_tag=TAG)
    for line in lines:
        for denial in parser.feed(line):
            assert isinstance(denial, SeatbeltDenial)
    parser.flush()


@settings(max_examples=500)
@given(st.text(max_size=200))
def test_any_target_text_round_trips_and_never_changes_the_owner(target: str) -> None:
    line = ndjson(kernel(f"Sandbox: touch(7) deny(1) file-write-create /x/{target}"))
    mine = parse_all([line])
    assert len(mine) == 1
    assert mine[0].target == f"/x/{target}"
    assert parse_all([line], tag=OTHER) == []
