"""The gRPC core's own limits as the scheduler sets them, seen from raw HTTP/2 (the ``h2``
library) against a real scheduler: a client pinging too often is sent GOAWAY, and a caller
that stopped reading its socket is cut by keepalive, its unread answers given back."""

from __future__ import annotations

import socket
import time

import h2.config
import h2.connection
import h2.errors
import h2.events

from tests.fixtures.harness import make_settings, running_fleet, running_scheduler
from tests.fixtures.waiting import wait_for

LIST_NODES = "/persys.control.v1.AgentControl/ListNodes"


def _connect(port: int, *, rcvbuf: int = 0) -> tuple[socket.socket, h2.connection.H2Connection]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    return sock, conn


def _call(sock: socket.socket, conn: h2.connection.H2Connection, port: int, path: str) -> None:
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", path),
                            (":authority", f"127.0.0.1:{port}"),
                            ("content-type", "application/grpc"), ("te", "trailers")])
    conn.send_data(sid, b"\x00\x00\x00\x00\x00", end_stream=True)
    sock.sendall(conn.data_to_send())


async def test_a_client_pinging_too_often_is_sent_goaway(etcd_server, redis_server, key_root,
                                                          stream_key) -> None:
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched:
        sock, conn = _connect(sched.grpc_port)
        sock.settimeout(0.2)
        try:
            terminated: list[h2.events.ConnectionTerminated] = []

            def goaway() -> bool:
                # a ping every call, far more often than SCHEDULER_GRPC_MIN_PING_INTERVAL (10 s)
                conn.ping(time.monotonic_ns().to_bytes(8, "big"))
                try:
                    sock.sendall(conn.data_to_send())
                    data = sock.recv(65536)
                except TimeoutError:
                    return False
                except OSError:
                    return bool(terminated)
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ConnectionTerminated):
                        terminated.append(event)
                return bool(terminated)

            await wait_for(goaway, timeout=20, interval=0.05, message="no GOAWAY for a ping flood")
            assert terminated[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
            assert b"too_many_pings" in (terminated[0].additional_data or b"")
        finally:
            sock.close()


async def test_a_caller_that_stopped_reading_its_socket_is_cut_by_keepalive(
        etcd_server, redis_server, key_root, stream_key) -> None:
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             grpc_keepalive_time_s=1.0, grpc_keepalive_timeout_s=1.0)
    async with running_scheduler(settings) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        async with running_fleet(address, 40) as fleet:
            await fleet.wait_registered()
            sock, conn = _connect(sched.grpc_port, rcvbuf=4096)
            try:
                for _ in range(200):
                    _call(sock, conn, sched.grpc_port, LIST_NODES)
                ledger = sched.grpc.unread
                await wait_for(lambda: ledger.held > 0, message="answers left unread")
                # never read: the server's keepalive ping goes unanswered and the connection
                # is closed, its calls ended and their answers given back
                await wait_for(lambda: ledger.held == 0, timeout=20,
                               message="keepalive did not cut a caller that stopped reading")
            finally:
                sock.close()
