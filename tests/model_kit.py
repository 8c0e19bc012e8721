"""A small fake Anthropic Messages API on the host's loopback, for the dispatch tests.

It answers `POST /v1/messages` (streamed or not) from a script of tool calls: a request that
offers the script's next tool gets a `tool_use` block for it (the step is the number of
`tool_result` blocks the conversation already holds), and one past the script, or a side request
that offers no such tool (a title, a summary), gets a short text. Everything it receives is
recorded: each request's headers and body, and what the agent told its model about each tool
call (`feedback`). Over HTTPS with a certificate from a test CA (`UpstreamCA`), or plain HTTP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import http.server
import ipaddress
import json
import ssl
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclasses.dataclass(frozen=True)
class ToolStep:
    """One tool call the fake model makes."""

    name: str  # Claude Code's tool name: Bash, Write, Read ...
    input: dict[str, Any]


@dataclasses.dataclass
class Received:
    """One request the fake API received."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]


class UpstreamCA:
    """A throw-away CA and a leaf for 127.0.0.1 / localhost, written as PEM files."""

    def __init__(self, directory: str) -> None:
        now = datetime.datetime.now(datetime.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cc-server test upstream CA")])
        ca = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256())
        )
        leaf_key = ec.generate_private_key(ec.SECP256R1())
        leaf = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(name).public_key(leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        pem = serialization.Encoding.PEM
        self.ca_file = f"{directory}/upstream-ca.crt"
        self.cert_file = f"{directory}/upstream.crt"
        self.key_file = f"{directory}/upstream.key.pem"
        with open(self.ca_file, "wb") as f:
            f.write(ca.public_bytes(pem))
        with open(self.cert_file, "wb") as f:
            f.write(leaf.public_bytes(pem))
        with open(self.key_file, "wb") as f:
            f.write(leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(b.get("content", b.get("text", ""))) for b in content
                       if isinstance(b, dict))
    return ""


def _feedback(body: dict[str, Any]) -> list[str]:
    """Per tool result, what the agent handed its model about the call: the result's text and
    the messages it added before the model's next turn (a hook's context)."""
    out: list[str] = []
    for message in body.get("messages", []):
        content = message.get("content")
        if message.get("role") == "assistant":
            continue
        blocks = content if isinstance(content, list) else [{"type": "text", "text": content}]
        for block in blocks:
            if not isinstance(block, dict):
                continue
            if block.get("type") == "tool_result":
                out.append(_text(block.get("content")))
            elif out:
                out[-1] += "\n" + _text(block.get("text", block.get("content", "")))
    return out


def _tool_results(body: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for message in body.get("messages", []):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for block in content:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                inner = block.get("content")
                if isinstance(inner, list):
                    inner = "".join(b.get("text", "") for b in inner if isinstance(b, dict))
                out.append(str(inner or ""))
    return out


class FakeModel:
    """The script and what was received; `answer(body)` is the reply's message."""

    def __init__(self, steps: Sequence[ToolStep]) -> None:
        self.steps = list(steps)
        self.received: list[Received] = []
        self.lock = threading.Lock()

    @property
    def feedback(self) -> list[str]:
        """Per tool call of the script, what the model was told about it (`_feedback`), from
        the longest conversation."""
        with self.lock:
            return max((_feedback(r.body) for r in self.received), key=len, default=[])

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        offered = {t.get("name") for t in body.get("tools", []) if isinstance(t, dict)}
        step = len(_tool_results(body))
        content: list[dict[str, Any]]
        if step < len(self.steps) and self.steps[step].name in offered:
            tool = self.steps[step]
            content = [{"type": "tool_use", "id": f"toolu_{step:04d}", "name": tool.name,
                        "input": tool.input}]
            stop = "tool_use"
        else:
            content = [{"type": "text", "text": "done"}]
            stop = "end_turn"
        return {"id": f"msg_{step:04d}", "type": "message", "role": "assistant",
                "model": body.get("model", "claude-test"), "content": content,
                "stop_reason": stop, "stop_sequence": None,
                "usage": {"input_tokens": 10, "output_tokens": 5}}


def _events(message: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    start = {**message, "content": [], "stop_reason": None}
    yield "message_start", {"type": "message_start", "message": start}
    for i, block in enumerate(message["content"]):
        if block["type"] == "tool_use":
            yield "content_block_start", {"type": "content_block_start", "index": i,
                                          "content_block": {**block, "input": {}}}
            yield "content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])}}
        else:
            yield "content_block_start", {"type": "content_block_start", "index": i,
                                          "content_block": {"type": "text", "text": ""}}
            yield "content_block_delta", {"type": "content_block_delta", "index": i,
                                          "delta": {"type": "text_delta", "text": block["text"]}}
        yield "content_block_stop", {"type": "content_block_stop", "index": i}
    yield "message_delta", {"type": "message_delta", "delta": {
        "stop_reason": message["stop_reason"], "stop_sequence": None},
        "usage": {"output_tokens": 5}}
    yield "message_stop", {"type": "message_stop"}


@contextlib.contextmanager
def fake_messages_api(
    steps: Sequence[ToolStep], *, tls: UpstreamCA | None = None
) -> Iterator[tuple[str, FakeModel]]:
    """Serve the fake API on 127.0.0.1; yields its base URL and the model."""
    model = FakeModel(steps)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                body = {}
            with model.lock:
                model.received.append(Received(self.path, dict(self.headers.items()), body))
            if not self.path.startswith("/v1/messages") or "count_tokens" in self.path:
                self._send(200, json.dumps({"input_tokens": 10}).encode(), "application/json")
                return
            message = model.answer(body)
            if not body.get("stream"):
                self._send(200, json.dumps(message).encode(), "application/json")
                return
            stream = "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n"
                             for name, data in _events(message)).encode()
            self._send(200, stream, "text/event-stream")

        def do_GET(self) -> None:
            with model.lock:
                model.received.append(Received(self.path, dict(self.headers.items()), {}))
            self._send(404, b"{}", "application/json")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls is not None:
        server.socket = tls.server_context().wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, name="fake-messages-api", daemon=True)
    thread.start()
    scheme = "https" if tls is not None else "http"
    try:
        yield f"{scheme}://127.0.0.1:{server.server_address[1]}", model
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
