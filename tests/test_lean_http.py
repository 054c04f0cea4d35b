"""The etcd gateway's HTTP client (eventsource/lean_http.py).

Against a real etcd: round trips, a response too big for one write (the gateway then frames it
chunked) and keep-alive. Against a scripted peer on loopback: the framings and failures a gateway
or a proxy in front of it can produce, which a healthy etcd does not produce on demand.
"""

from __future__ import annotations

import base64
import socket
import threading
from collections.abc import Callable, Iterator

import pytest
import requests

from eventsource.lean_http import LeanSession


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_round_trips_keep_alive_and_a_chunked_range_on_real_etcd(etcd_server, key_root) -> None:
    session = LeanSession("http", etcd_server.host, etcd_server.client_port)
    try:
        for i in range(300):
            put = {"key": _b64(f"{key_root}/k/{i:04d}"), "value": _b64("v" * 200)}
            answer = session.post(f"http://{etcd_server.endpoint}/v3/kv/put", json=put, timeout=5)
            assert answer.status_code == 200, answer.text
        reader = session._reader
        found = session.post(f"http://{etcd_server.endpoint}/v3/kv/range", timeout=5, json={
            "key": _b64(f"{key_root}/k/"), "range_end": _b64(f"{key_root}/k0")})
        assert session._reader is reader, "keep-alive: the same connection served every call"
        assert len(found.body) > 64 * 1024  # far past one write: framed chunked by the gateway
        kvs = found.json()["kvs"]
        assert [base64.b64decode(kv["key"]).decode() for kv in kvs] == [
            f"{key_root}/k/{i:04d}" for i in range(300)]
        missing = session.post(f"http://{etcd_server.endpoint}/v3/kv/nosuch", json={}, timeout=5)
        assert missing.status_code == 404
    finally:
        session.close()


class ScriptedPeer:
    """A loopback listener that answers each request with the next scripted reply.

    A reply is bytes to send, or a callable given the connection (to stall, or close early).
    """

    def __init__(self, replies: list[bytes | Callable[[socket.socket], None]]) -> None:
        self.replies = list(replies)
        self.connections = 0
        self.requests: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.replies:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                while self.replies:
                    request = _read_request(conn)
                    if request is None:
                        break
                    self.requests.append(request)
                    reply = self.replies.pop(0)
                    if callable(reply):
                        reply(conn)
                        break
                    conn.sendall(reply)
                    if b"Connection: close" in reply or b"HTTP/1.0" in reply:
                        break

    def close(self) -> None:
        self.listener.close()


def _read_request(conn: socket.socket) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


@pytest.fixture
def peer() -> Iterator[Callable[..., tuple[ScriptedPeer, LeanSession]]]:
    made: list[tuple[ScriptedPeer, LeanSession]] = []

    def make(*replies: bytes | Callable[[socket.socket], None]) -> tuple[ScriptedPeer,
                                                                       LeanSession]:
        scripted = ScriptedPeer(list(replies))
        made.append((scripted, LeanSession("http", "127.0.0.1", scripted.port)))
        return made[-1]

    yield make
    for scripted, session in made:
        session.close()
        scripted.close()


OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"a":"one"}'


def test_chunked_with_extensions_and_trailers(peer) -> None:
    scripted, session = peer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"4;name=x\r\n{\"a\"\r\n7\r\n:\"two\"}\r\n"
                             b"0\r\nX-Trailer: 1\r\n\r\n", OK)
    assert session.post_bytes("/v3/kv/range", b"{}", timeout=5).json() == {"a": "two"}
    assert session.post_bytes("/v3/kv/range", b"{}", timeout=5).json() == {"a": "one"}
    assert scripted.connections == 1
    head = scripted.requests[0].split(b"\r\n\r\n")[0]
    assert head.startswith(b"POST /v3/kv/range HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{scripted.port}".encode() in head


def test_interim_100_is_skipped(peer) -> None:
    _, session = peer(b"HTTP/1.1 100 Continue\r\n\r\n" + OK)
    assert session.post_bytes("/x", b"{}", timeout=5).json() == {"a": "one"}


def test_connection_close_and_http_1_0_open_a_new_connection(peer) -> None:
    scripted, session = peer(
        b'HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}',
        b'HTTP/1.0 200 OK\r\n\r\n{"to":"close"}',
        OK)
    assert session.post_bytes("/x", b"{}", timeout=5).json() == {}
    assert session.post_bytes("/x", b"{}", timeout=5).json() == {"to": "close"}
    assert session.post_bytes("/x", b"{}", timeout=5).json() == {"a": "one"}
    assert scripted.connections == 3


def test_an_idle_connection_the_peer_closed_is_replaced_before_sending(peer) -> None:
    def answer_then_close(conn: socket.socket) -> None:
        conn.sendall(OK)
        conn.shutdown(socket.SHUT_RDWR)

    scripted, session = peer(answer_then_close, OK)
    assert session.post_bytes("/x", b"{}", timeout=5).json() == {"a": "one"}
    reader = session._reader
    assert reader is not None
    # wait until the close reached us, then make sure the next call does not use that socket
    reader.sock.settimeout(5)
    assert reader.sock.recv(1, socket.MSG_PEEK) == b""
    assert session.post_bytes("/x", b"{}", timeout=5).json() == {"a": "one"}
    assert scripted.connections == 2


@pytest.mark.parametrize("reply", [
    b"SSH-2.0-OpenSSH\r\n\r\n",                                    # not HTTP at all
    b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{\"short\":1}",  # closed mid-body
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # bad chunk size
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",               # bad length
], ids=["not-http", "closed-mid-body", "bad-chunk-size", "bad-length"])
def test_a_broken_answer_is_a_connection_error_and_the_connection_is_dropped(peer,
                                                                             reply) -> None:
    def send_and_close(conn: socket.socket) -> None:
        conn.sendall(reply)
        conn.shutdown(socket.SHUT_RDWR)

    _, session = peer(send_and_close)
    with pytest.raises(requests.exceptions.ConnectionError):
        session.post_bytes("/x", b"{}", timeout=5)
    assert session._reader is None


def test_a_silent_peer_is_a_timeout(peer) -> None:
    released = threading.Event()
    _, session = peer(lambda conn: released.wait(10))
    try:
        with pytest.raises(requests.exceptions.Timeout):
            session.post_bytes("/x", b"{}", timeout=0.3)
        assert session._reader is None
    finally:
        released.set()


def test_nobody_listening_is_a_connection_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    session = LeanSession("http", "127.0.0.1", port)
    with pytest.raises(requests.exceptions.ConnectionError):
        session.post(f"http://127.0.0.1:{port}/v3/kv/range", json={}, timeout=2)
