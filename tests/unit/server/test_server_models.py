"""The API's published shapes match what the runtime sends, and the OpenAPI document holds
together."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from cc_server.policy import SandboxBackend
from cc_server.runtime.events import EventType, SandboxEvent, SandboxViolation
from cc_server.server.models import (
    CreateSandboxRequest,
    CreateSandboxWire,
    SandboxEventView,
    SandboxHandleView,
)
from cc_server.server.openapi import openapi_document
from cc_server.server.status import BACKEND_UNAVAILABLE_STATUS

VIOLATION = SandboxViolation(action="network-outbound", target="evil.example:443",
                             suggested_capability="canCallGitHubApi", raw="line")


def test_the_handle_view_is_what_to_json_sends() -> None:
    sent = {"sessionId": "s", "backend": "native", "state": "warm", "error": None,
            "details": {"workdir": "/w"}, "violations": [VIOLATION.to_json()]}
    view = msgspec.convert(sent, SandboxHandleView)
    assert msgspec.to_builtins(view) == sent


@pytest.mark.parametrize(
    "event",
    [
        SandboxEvent(type=EventType.STARTING, session_id="s", exec_id="s:1"),
        SandboxEvent(type=EventType.STDOUT, session_id="s", exec_id="s:1", data=b"hi\xff"),
        SandboxEvent(type=EventType.EXIT, session_id="s", exec_id="s:1", exit_code=0),
        SandboxEvent(type=EventType.KILLED, session_id="s", exec_id="s:1", reason="timeout"),
        SandboxEvent(type=EventType.VIOLATION, session_id="s", violation=VIOLATION),
    ],
)
def test_every_event_fits_the_event_view(event: SandboxEvent) -> None:
    sent = event.to_json()
    view = msgspec.convert(sent, SandboxEventView)  # unknown fields would be refused
    assert msgspec.to_builtins(view) == sent


def test_the_decoded_and_the_published_create_bodies_agree() -> None:
    assert CreateSandboxWire.__struct_fields__ == CreateSandboxRequest.__struct_fields__
    published = msgspec.json.schema(CreateSandboxRequest)["$defs"]["SandboxBackend"]
    assert published["enum"] == sorted(b.value for b in SandboxBackend)


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for value in node.values() for r in refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in refs(value)]
    return []


def test_the_openapi_document_resolves_every_reference() -> None:
    doc = openapi_document()
    assert doc["openapi"] == "3.1.0"
    schemas = doc["components"]["schemas"]
    for ref in refs(doc):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas
    spec = schemas["SandboxSpec"]
    assert spec["additionalProperties"] is False and "bindMounts" in spec["properties"]
    assert doc["paths"]["/healthz"]["get"]["security"] == []
    create = doc["paths"]["/v1/sandboxes"]["post"]["responses"]
    assert str(BACKEND_UNAVAILABLE_STATUS) in create and "400" in create
    assert "sandbox" not in schemas["Health"]["properties"]
