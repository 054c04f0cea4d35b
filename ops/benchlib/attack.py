"""Scenario ``attack``: what one hostile caller costs everyone else (``--attack KIND``).

A probe (``ops.benchlib.probe``, a process of its own with its own channel) calls
GetClusterSummary every 0.5 s with a 10 s timeout, and the bench samples the scheduler's
``VmRSS`` every 0.5 s, over three phases: a quiet baseline (``--attack-quiet`` s), the attack
(``--attack-duration`` s, longer when the attack itself takes longer), and a quiet after
(``--attack-quiet`` s) once the attacker is gone. The attacks (``--attack-size`` callers,
streams, watchers or nodes):

* ``nonreading``: N callers, each on a TCP connection of its own, send one ListNodes request in
  raw HTTP/2 (``ops.benchlib.h2raw``: they open both flow-control windows to the maximum, so
  only TCP holds the answer back, and never call ``recv``; a grpc client would read its socket
  on its own threads). Give a fleet whose ListNodes answer is large (``--nodes 1000``);
* ``nonreading-window``: N callers, each on a TCP connection of its own, keep the HTTP/2
  default windows (65,535 bytes, stream and connection; no WINDOW_UPDATE ever), read their
  socket (SETTINGS and PING acknowledged, so keepalive does not cut them) and send up to
  ``--attack-requests`` ListNodes requests each, ``IN_FLIGHT`` at a time not yet begun by the
  server: the server can send 64 KiB of all a connection's answers and must hold the rest.
  The callers decode the server's header blocks (``h2raw.HeaderDecoder``) and count the
  answers' ``grpc-status``; the attack stops early when the scheduler's RSS passes
  ``RSS_STOP_MIB``;
* ``resets``: one connection sends N whole GetClusterSummary requests (HEADERS, DATA with
  END_STREAM), each followed at once by its RST_STREAM (CANCEL), as fast as the socket takes
  them; it reads the connection (SETTINGS and PING acknowledged) and stops at a GOAWAY;
* ``watchers``: N WatchEvents streams opened at once (grpc aio, 100 per channel), while the
  bench sets a node label ``WATCH_EVENT_RATE`` times a second, so each stream carries events;
* ``heartbeats``: N more simulated nodes (``persys-scheduler sim`` processes, one per 2,500
  nodes unless ``--sim-processes`` says otherwise, each with one control connection per
  ``FLOOD_NODES_PER_CHANNEL`` nodes) started at the attack's start, registering
  and heartbeating every ``FLOOD_HEARTBEAT_S`` seconds (the simulator's own pace bounds it).
  They are stopped at the end of the attack; their nodes stay in the target.

Every figure is from the outside: the probe's answers, ``/proc/PID/status``, and what the
attacker saw (refusals, GOAWAYs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc

from ops.benchlib import h2raw
from ops.benchlib.fleetstats import merge_fleet_stats
from ops.benchlib.httpget import HttpError, get_json
from ops.benchlib.procs import Child, rss_mib
from ops.benchlib.quantiles import percentile
from ops.benchlib.scenario import (
    NO_PID,
    PEAK_RSS,
    SCHEDULER_PREFIX,
    BenchContext,
    Outcome,
    Scenario,
)
from ops.benchlib.stack import HOST, StackOptions, service_port
from proto.persys.control.v1 import control_pb2, control_pb2_grpc

ATTACKS = ("nonreading", "nonreading-window", "resets", "watchers", "heartbeats")
DEFAULT_SIZE = {"nonreading": 300, "nonreading-window": 20, "resets": 100_000, "watchers": 500,
                "heartbeats": 5000}
#: nonreading-window: ListNodes requests per caller (``--attack-requests``).
DEFAULT_REQUESTS = 200
#: nonreading-window: requests per caller sent and not yet begun by the server (no HEADERS back).
IN_FLIGHT = 4
#: nonreading-window: the attack stops (its callers close) once the scheduler's RSS passes this.
RSS_STOP_MIB = 6144.0
PHASES = ("baseline", "during", "after")
PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 10.0
RSS_INTERVAL_S = 0.5
#: SetNodeLabel calls per second while the watchers are open (each event goes to every one).
WATCH_EVENT_RATE = 2.0
WATCHERS_PER_CHANNEL = 100
#: The flood's heartbeat interval (the simulator's override of the scheduler's answer).
FLOOD_HEARTBEAT_S = 1.0
#: The flood's simulators open one control connection per this many nodes (``--control-channels``),
#: so that no connection carries more calls at once than SCHEDULER_GRPC_MAX_CONCURRENT_STREAMS
#: (1,024) and a target with that limit gets the same load as one without.
FLOOD_NODES_PER_CHANNEL = 50
#: An attack that has not ended this long after its window is stopped.
OVERRUN_S = 120.0
#: A nonreading caller's receive buffer: the kernel takes this much of the answer, no more.
NONREADING_RCVBUF = 4096
LIST_NODES = "/persys.control.v1.AgentControl/ListNodes"
SUMMARY = "/persys.control.v1.AgentControl/GetClusterSummary"
_ROOT = Path(__file__).resolve().parents[2]

PROBE_FIGURES = tuple(f"probe_{phase}_{kind}" for phase in PHASES
                      for kind in ("p50_ms", "p99_ms", "max_ms", "timeouts", "errors"))
FIGURES = (
    *PROBE_FIGURES,
    "scheduler_rss_baseline_mib",
    "scheduler_rss_peak_during_mib",
    "scheduler_rss_after_mib",
    "attack_size",
    "attack_s",
    "attack_refused_resource_exhausted",
    "attack_refused_unavailable",
    "attack_goaways",
    "attack_streams_before_goaway",
    "attack_watchers_open",
    "attack_heartbeats_ok",
    "attack_streams_open",
    "list_nodes_answer_kib",
    PEAK_RSS,
)
#: The figures only some attacks have, and which.
ONLY = {
    "attack_goaways": ("resets",),
    "attack_streams_before_goaway": ("resets",),
    "attack_watchers_open": ("watchers",),
    "attack_heartbeats_ok": ("heartbeats",),
    "attack_streams_open": ("nonreading-window",),
    "list_nodes_answer_kib": ("nonreading", "nonreading-window"),
}


class ProbeProcess:
    """``python -m ops.benchlib.probe`` and the answers it printed: (start wall time, ms, code)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.results: list[tuple[float, float, str]] = []
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ops.benchlib.probe", self.address,
            "--interval", f"{PROBE_INTERVAL_S:g}", "--timeout", f"{PROBE_TIMEOUT_S:g}",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, cwd=_ROOT, start_new_session=True)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self._proc is not None
        assert self._proc.stdout is not None
        async for line in self._proc.stdout:
            with contextlib.suppress(ValueError, KeyError):
                record = json.loads(line)
                self.results.append((float(record["t"]), float(record["ms"]),
                                     str(record["code"])))

    async def stop(self) -> None:
        """SIGTERM: it starts no more calls and waits for those in flight (at most the timeout)."""
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), PROBE_TIMEOUT_S + 5.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


class RssSampler:
    """VmRSS of the scheduler processes, summed, every ``RSS_INTERVAL_S``: (wall time, MiB)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.samples: list[tuple[float, float]] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            values = [rss_mib(pid) for pid in self.pids]
            if values and all(v is not None for v in values):
                self.samples.append((time.time(), sum(v for v in values if v is not None)))
            await asyncio.sleep(RSS_INTERVAL_S)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def between(self, start: float, end: float) -> list[float]:
        return [mib for t, mib in self.samples if start <= t < end]


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


# -- the attacks ------------------------------------------------------------------------------
# Each runs until ``until`` (time.monotonic()) and longer when its own work takes longer, and
# records its figures and notes in ``out``.


async def _list_nodes_size(ctx: BenchContext, out: Outcome) -> int:
    reply = await ctx.api.stubs[0].ListNodes(control_pb2.ListNodesRequest(), timeout=60.0)
    out.figures["list_nodes_answer_kib"] = round(reply.ByteSize() / 1024.0, 1)
    out.note("list_nodes_answer_kib", f"one ListNodes answer ({len(reply.nodes)} nodes), "
             "serialized, read by the bench before the attack")
    return int(reply.ByteSize())


async def _nonreading(ctx: BenchContext, out: Outcome, size: int, until: float) -> None:
    address = ctx.stack.grpc_addrs[0]
    host, port = _host_port(address)
    await _list_nodes_size(ctx, out)
    block = h2raw.grpc_request_headers(address, LIST_NODES)
    request = (h2raw.client_start(window=h2raw.MAX_WINDOW, ack_settings=True)
               + h2raw.unary_call(1, block))
    sockets: list[socket.socket] = []
    failed: Counter[str] = Counter()

    def connect_all() -> None:
        for _ in range(size):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, NONREADING_RCVBUF)
                sock.settimeout(10.0)
                sock.connect((host, port))
                sock.sendall(request)
            except OSError as exc:
                failed[type(exc).__name__] += 1
                sock.close()
                continue
            sockets.append(sock)

    try:
        await asyncio.to_thread(connect_all)
        out.figures["attack_size"] = len(sockets)
        out.note("attack_size", f"connections that sent their ListNodes request (asked {size})"
                 + (f"; failed: {dict(failed)}" if failed else ""))
        ctx.log(f"attack nonreading: {len(sockets)} callers sent ListNodes and do not read")
        await asyncio.sleep(max(0.0, until - time.monotonic()))
        # what the server did meanwhile is in the unread bytes; peeking reads nothing
        closed = sum(1 for s in sockets if _peer_closed(s))
        out.note("attack_size", f"{closed} of them found closed by the server at the end of the "
                 "attack (a FIN or RST behind the unread bytes)")
    finally:
        for sock in sockets:
            sock.close()
    for key in ("attack_refused_resource_exhausted", "attack_refused_unavailable",
                "attack_goaways"):
        out.null(key, "a nonreading caller reads nothing, so it cannot see a refusal or a "
                 "GOAWAY; the note of attack_size says how many connections the server closed")


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the server closed the connection, without taking a byte from its buffer: only
    an error or EOF at the head of the buffer shows (data still queued hides a later FIN)."""
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return data == b""


class _WindowCaller:
    """One nonreading-window caller: its connection, what it read, stream by stream. It keeps
    ``IN_FLIGHT`` requests the server has not begun to answer (no HEADERS back yet), up to
    ``requests`` in all: a burst of all of them at once would wait in gRPC core's queue, which
    cancels a call left unclaimed 30 s (CANCELLED, measured), so it would measure the server's
    CPU, not what it holds."""

    def __init__(self, requests: int, block: bytes) -> None:
        self.requests = requests
        self.block = block
        self.sent = 0
        self.begun: set[int] = set()  # streams the server sent HEADERS on (answer begun)
        self.writer: asyncio.StreamWriter | None = None
        self.reading: asyncio.Task[None] | None = None
        self.statuses: dict[int, str] = {}  # stream id -> grpc-status of its final HEADERS
        self.headers_only: set[int] = set()  # streams ended by HEADERS with no DATA before
        self.with_data: set[int] = set()
        self.resets: dict[int, int] = {}  # stream id -> RST_STREAM code
        self.data_bytes = 0
        self.pings = 0
        self.goaways: list[tuple[int, int]] = []
        self.closed = False
        self.error = ""

    async def read(self, reader: asyncio.StreamReader) -> None:
        frames = h2raw.FrameReader()
        decoder = h2raw.HeaderDecoder()
        block = bytearray()
        block_stream, block_ends = 0, False
        writer = self.writer
        assert writer is not None
        try:
            while data := await reader.read(65536):
                for f in frames.feed(data):
                    if ack := h2raw.ack_of(f):
                        if f.kind == h2raw.PING:
                            self.pings += 1
                        writer.write(ack)
                    elif f.kind == h2raw.GOAWAY:
                        self.goaways.append(h2raw.goaway_fields(f.payload))
                    elif f.kind == h2raw.RST_STREAM:
                        self.resets[f.stream_id] = h2raw.rst_code(f)
                    elif f.kind == h2raw.DATA:
                        # never a WINDOW_UPDATE: the server's 65,535 bytes are all it may send
                        self.data_bytes += len(f.payload)
                        self.with_data.add(f.stream_id)
                    elif f.kind in (h2raw.HEADERS, h2raw.CONTINUATION):
                        if f.kind == h2raw.HEADERS:
                            block.clear()
                            block_stream = f.stream_id
                            block_ends = bool(f.flags & h2raw.END_STREAM)
                        block += h2raw.header_block_fragment(f)
                        if f.flags & h2raw.END_HEADERS:
                            self.begun.add(block_stream)
                            self._headers(block_stream, block_ends, decoder.decode(bytes(block)))
                self.top_up()
        except (OSError, ValueError, IndexError) as exc:
            self.error = f"{type(exc).__name__} {exc}"
        finally:
            self.closed = True

    def top_up(self) -> None:
        """Send requests until ``IN_FLIGHT`` are not begun (or all ``requests`` are sent)."""
        assert self.writer is not None
        waiting = self.sent - len(self.begun | set(self.resets))
        batch = bytearray()
        while waiting < IN_FLIGHT and self.sent < self.requests:
            batch += h2raw.unary_call(2 * self.sent + 1, self.block)
            self.sent += 1
            waiting += 1
        if batch:
            self.writer.write(bytes(batch))

    def _headers(self, stream_id: int, ends: bool,
                 fields: list[tuple[bytes | None, bytes | None]]) -> None:
        if not ends:
            return  # the answer's response headers; its message and trailers come later
        status = next((v for n, v in fields if n == b"grpc-status"), None)
        self.statuses[stream_id] = status.decode() if status is not None else "?"
        if stream_id not in self.with_data:
            self.headers_only.add(stream_id)


async def _nonreading_window(ctx: BenchContext, out: Outcome, size: int, until: float) -> None:
    address = ctx.stack.grpc_addrs[0]
    host, port = _host_port(address)
    answer = await _list_nodes_size(ctx, out)
    requests = int(ctx.args.attack_requests)
    block = h2raw.grpc_request_headers(address, LIST_NODES)
    # the default window, said explicitly; no WINDOW_UPDATE follows, ever
    start = h2raw.client_start(window=h2raw.DEFAULT_WINDOW)
    callers: list[_WindowCaller] = []
    failed: Counter[str] = Counter()
    pids = [pid for name, pid in ctx.stack.scheduler_pids.items()
            if name.startswith(SCHEDULER_PREFIX)]

    async def connect() -> None:
        caller = _WindowCaller(requests, block)
        try:
            reader, caller.writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), 10.0)
            caller.writer.write(start)
            caller.top_up()
            caller.reading = asyncio.create_task(caller.read(reader))
            await caller.writer.drain()
        except (OSError, TimeoutError) as exc:
            failed[type(exc).__name__] += 1
            if caller.writer is not None:
                caller.writer.close()
            return
        callers.append(caller)

    stopped = ""
    began = time.monotonic()
    try:
        await asyncio.gather(*(connect() for _ in range(size)))
        ctx.log(f"attack nonreading-window: {len(callers)} callers send {requests} ListNodes "
                f"each ({IN_FLIGHT} not begun at a time), windows left at 65,535")
        while time.monotonic() < until:
            await asyncio.sleep(min(RSS_INTERVAL_S, max(0.0, until - time.monotonic())))
            values = [rss_mib(pid) for pid in pids]
            held = sum(v for v in values if v is not None)
            if held > RSS_STOP_MIB:
                stopped = (f"stopped early, {time.monotonic() - began:.1f} s into the attack: "
                           f"the scheduler's RSS was {held:.0f} MiB, past {RSS_STOP_MIB:g}")
                ctx.log(f"attack nonreading-window: {stopped}")
                break
    finally:
        snapshot = [(dict(c.statuses), set(c.headers_only), dict(c.resets), c.closed)
                    for c in callers]
        sent = sum(c.sent for c in callers)
        begun = sum(len(c.begun) for c in callers)
        for caller in callers:
            if caller.writer is not None:
                caller.writer.close()
        for caller in callers:
            if caller.reading is not None:
                caller.reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await caller.reading
    statuses: Counter[str] = Counter()
    resets: Counter[int] = Counter()
    headers_only = closed = 0
    for caller_statuses, caller_only, caller_resets, caller_closed in snapshot:
        statuses.update(caller_statuses.values())
        resets.update(caller_resets.values())
        headers_only += len(caller_only)
        closed += caller_closed
    ended = sum(len(set(s) | set(r)) for s, _, r, _ in snapshot)
    out.figures["attack_size"] = len(callers)
    out.note("attack_size", f"connections that sent ListNodes requests (asked {size}, up to "
             f"{requests} requests each, {IN_FLIGHT} not begun at a time): {sent} requests sent, "
             f"{begun} answers begun (HEADERS back); one answer {answer / 1024:.1f} KiB: "
             f"{sent * answer / 2**20:.1f} MiB if the server held every one sent)"
             + (f"; failed: {dict(failed)}" if failed else "")
             + f"; {closed} connections closed by the server before the end"
             + (f"; {stopped}" if stopped else ""))
    out.figures["attack_refused_resource_exhausted"] = statuses.get("8", 0)
    out.figures["attack_refused_unavailable"] = (statuses.get("14", 0)
                                                 + resets.get(h2raw.REFUSED_STREAM, 0))
    out.note("attack_refused_resource_exhausted", "answers whose grpc-status (decoded from the "
             "server's final HEADERS) was 8; all final statuses: "
             + (", ".join(f"{n} x {c}" for c, n in sorted(statuses.items())) or "none")
             + f"; {headers_only} of the answers were headers-only (no DATA before them)")
    out.note("attack_refused_unavailable", "grpc-status 14 plus RST_STREAM REFUSED_STREAM; all "
             "RST_STREAM codes: " + (", ".join(f"{n} x 0x{c:x}" for c, n in
                                              sorted(resets.items())) or "none"))
    out.figures["attack_goaways"] = sum(len(c.goaways) for c in callers)
    codes = Counter(code for c in callers for _, code in c.goaways)
    out.note("attack_goaways", "GOAWAY frames read; codes: "
             + (", ".join(f"{n} x 0x{c:x}" for c, n in sorted(codes.items())) or "none")
             + f"; PINGs acknowledged: {sum(c.pings for c in callers)}; DATA read: "
             f"{sum(c.data_bytes for c in callers)} bytes (never a WINDOW_UPDATE)"
             + "".join(f"; a read ended: {c.error}" for c in callers[:1] if c.error))
    out.figures["attack_streams_open"] = sent - ended
    out.note("attack_streams_open", "requests neither answered to their end nor reset when the "
             "attack ended: answers the server was holding (or had not started) behind the "
             "closed windows")


async def _resets(ctx: BenchContext, out: Outcome, size: int, until: float) -> None:
    address = ctx.stack.grpc_addrs[0]
    host, port = _host_port(address)
    reader, writer = await asyncio.open_connection(host, port)
    block = h2raw.grpc_request_headers(address, SUMMARY)
    sent = 0
    goaway: list[tuple[int, int, int]] = []  # (streams sent when read, last stream id, code)
    rst_codes: Counter[int] = Counter()
    answered = 0
    closed = asyncio.Event()

    async def read() -> None:
        nonlocal answered
        frames = h2raw.FrameReader()
        try:
            while data := await reader.read(65536):
                for f in frames.feed(data):
                    if ack := h2raw.ack_of(f):
                        writer.write(ack)
                    elif f.kind == h2raw.GOAWAY:
                        last, code = h2raw.goaway_fields(f.payload)
                        goaway.append((sent, last, code))
                    elif f.kind == h2raw.RST_STREAM:
                        rst_codes[h2raw.rst_code(f)] += 1
                    elif f.kind == h2raw.HEADERS:
                        answered += 1
        except OSError:
            pass
        finally:
            closed.set()

    reading = asyncio.create_task(read())
    began = time.monotonic()
    error = ""
    try:
        writer.write(h2raw.client_start())
        batch = bytearray()
        for i in range(size):
            if goaway or closed.is_set():
                break
            stream_id = 2 * i + 1
            batch += h2raw.unary_call(stream_id, block) + h2raw.rst_stream(stream_id)
            sent += 1
            if len(batch) > 32_768:
                writer.write(bytes(batch))
                batch.clear()
                await writer.drain()
        if batch and not closed.is_set():
            writer.write(bytes(batch))
            await writer.drain()
    except OSError as exc:
        error = (f"the connection failed while writing, after {sent} streams: "
                 f"{type(exc).__name__} {exc}")
    wrote_s = time.monotonic() - began
    ctx.log(f"attack resets: {sent} streams opened and reset in {wrote_s:.1f}s"
            + (f"; GOAWAY after {goaway[0][0]}" if goaway else ""))
    with contextlib.suppress(TimeoutError):  # a GOAWAY still on its way
        await asyncio.wait_for(closed.wait(), max(2.0, until - time.monotonic()))
    server_closed = closed.is_set()
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    reading.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reading
    out.figures["attack_size"] = sent
    out.note("attack_size", f"streams opened (HEADERS + DATA with END_STREAM) and reset "
             f"(RST_STREAM CANCEL) on one connection in {wrote_s:.1f}s, of {size} asked"
             + (f"; {error}" if error else ""))
    out.figures["attack_goaways"] = len(goaway)
    out.figures["attack_refused_unavailable"] = rst_codes.get(h2raw.REFUSED_STREAM, 0)
    out.note("attack_refused_unavailable", "RST_STREAM REFUSED_STREAM from the server (a grpc "
             "client sees UNAVAILABLE); other RST_STREAM codes: "
             + (", ".join(f"{n} x 0x{c:x}" for c, n in sorted(rst_codes.items())
                          if c != h2raw.REFUSED_STREAM) or "none")
             + f"; response HEADERS frames read: {answered}")
    out.null("attack_refused_resource_exhausted", "grpc status is in the trailers, which the "
             "resetting caller does not decode (the streams are reset)")
    if goaway:
        streams, last, code = goaway[0]
        out.figures["attack_streams_before_goaway"] = streams
        out.note("attack_streams_before_goaway", f"streams written when the first GOAWAY was "
                 f"read: last stream id {last} (the server's stream {(last + 1) // 2}), error "
                 f"code 0x{code:x}")
    else:
        out.null("attack_streams_before_goaway", "no GOAWAY came"
                 + ("; the server closed the connection" if server_closed else ""))


async def _watchers(ctx: BenchContext, out: Outcome, size: int, until: float) -> None:
    address = ctx.stack.grpc_addrs[0]
    channels = [grpc.aio.insecure_channel(address)
                for _ in range(math.ceil(size / WATCHERS_PER_CHANNEL))]
    stubs: list[Any] = [control_pb2_grpc.AgentControlStub(c)  # type: ignore[no-untyped-call]
                        for c in channels]
    codes: Counter[str] = Counter()
    calls: list[Any] = []
    received = 0
    ending = False

    async def watch(i: int) -> None:
        nonlocal received
        call = stubs[i % len(stubs)].WatchEvents(control_pb2.WatchEventsRequest())
        calls.append(call)
        try:
            async for _ in call:
                received += 1
        except grpc.aio.AioRpcError as exc:
            if not ending:
                codes[exc.code().name] += 1

    nodes = await ctx.stack.own_nodes(ctx.api)
    tasks = [asyncio.create_task(watch(i)) for i in range(size)]
    labels: Counter[str] = Counter()
    try:
        i = 0
        began = time.monotonic()
        while time.monotonic() < until:
            i += 1
            try:
                await ctx.api.stubs[0].SetNodeLabel(control_pb2.SetNodeLabelRequest(
                    node_id=nodes[i % len(nodes)], key="bench-attack", value=str(i)),
                    timeout=PROBE_TIMEOUT_S)
                labels["OK"] += 1
            except grpc.aio.AioRpcError as exc:
                labels[exc.code().name] += 1
            await asyncio.sleep(max(0.0, began + i / WATCH_EVENT_RATE - time.monotonic()))
        open_now = sum(1 for t in tasks if not t.done())
    finally:
        ending = True
        for call in calls:
            call.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in channels:
            await channel.close()
    out.figures["attack_size"] = size
    out.note("attack_size", f"WatchEvents streams opened at once over {len(channels)} channels")
    out.figures["attack_watchers_open"] = open_now
    out.figures["attack_refused_resource_exhausted"] = codes.get("RESOURCE_EXHAUSTED", 0)
    out.figures["attack_refused_unavailable"] = codes.get("UNAVAILABLE", 0)
    out.note("attack_watchers_open", f"streams still open at the end of the attack; "
             f"{received} events received in all; SetNodeLabel at {WATCH_EVENT_RATE:g}/s: "
             + ", ".join(f"{n} {c}" for c, n in sorted(labels.items()))
             + "; streams ended early: " + (", ".join(f"{n} {c}" for c, n in
                                                       sorted(codes.items())) or "none"))
    out.null("attack_goaways", "grpc aio hides GOAWAY frames (a stream cut by one ends "
             "UNAVAILABLE, counted)")


async def _heartbeats(ctx: BenchContext, out: Outcome, size: int, until: float) -> None:
    address = ",".join(ctx.stack.grpc_addrs)
    parts = StackOptions(nodes=size, sim_processes=ctx.args.sim_processes).fleet_parts()
    taken: set[int] = set()
    sims: list[Child] = []
    stats_addrs: list[str] = []
    prefix = f"{ctx.prefix}-flood-"
    try:
        for i, (first, count) in enumerate(parts):
            port = service_port(taken)
            argv = [sys.executable, "-m", "ops.cli", "sim", "--scheduler", address,
                    "--nodes", str(count), "--first-index", str(first),
                    "--stats-port", str(port), "--report-every", "0", "--prefix", prefix,
                    "--heartbeat-interval", f"{FLOOD_HEARTBEAT_S:g}",
                    "--control-channels", str(math.ceil(count / FLOOD_NODES_PER_CHANNEL)),
                    "--seed", str(ctx.args.seed + 100 + i)]
            sims.append(Child(f"flood-{i}", argv, env=dict(os.environ),
                              log=ctx.stack.workdir / f"flood-{i}.log", cwd=_ROOT))
            stats_addrs.append(f"{HOST}:{port}")
        ctx.log(f"attack heartbeats: {size} nodes in {len(parts)} simulator process(es), "
                f"heartbeating every {FLOOD_HEARTBEAT_S:g}s, one connection per "
                f"{FLOOD_NODES_PER_CHANNEL} nodes")
        await asyncio.sleep(max(0.0, until - time.monotonic()))
        try:
            stats = merge_fleet_stats(list(await asyncio.gather(
                *(get_json(a, "/stats", timeout=30.0) for a in stats_addrs))))
        except (OSError, HttpError) as exc:
            stats = {}
            out.null("attack_heartbeats_ok", f"the flood's /stats did not answer: {exc}")
    finally:
        for sim in sims:
            sim.terminate()
        for sim in sims:
            await asyncio.to_thread(sim.wait_or_kill, 20.0)
    out.figures["attack_size"] = size
    out.note("attack_size", f"simulated nodes ({prefix}NNNNN) in {len(parts)} process(es), "
             f"one control connection per {FLOOD_NODES_PER_CHANNEL} nodes: "
             + ", ".join(f"{math.ceil(count / FLOOD_NODES_PER_CHANNEL)}" for _, count in parts))
    control = stats.get("control", {}) if stats else {}
    if stats:
        out.figures["attack_heartbeats_ok"] = int(control.get("heartbeats_ok", 0))
        out.note("attack_heartbeats_ok", "answered Heartbeats during the attack; the flood's "
                 "control counters: " + ", ".join(f"{k} {v}" for k, v in sorted(control.items())))
        out.figures["attack_refused_resource_exhausted"] = sum(
            int(v) for k, v in control.items() if k.endswith("_RESOURCE_EXHAUSTED"))
        out.figures["attack_refused_unavailable"] = sum(
            int(v) for k, v in control.items() if k.endswith("_UNAVAILABLE"))
    out.null("attack_goaways", "the simulator's grpc channels hide GOAWAY frames")


RUNNERS = {"nonreading": _nonreading, "nonreading-window": _nonreading_window,
           "resets": _resets, "watchers": _watchers, "heartbeats": _heartbeats}


# -- the scenario -----------------------------------------------------------------------------


def _probe_figures(out: Outcome, phase: str, results: list[tuple[float, float, str]]) -> None:
    timed = [ms for _, ms, code in results if code in ("OK", "DEADLINE_EXCEEDED")]
    timeouts = sum(1 for _, _, code in results if code == "DEADLINE_EXCEEDED")
    errors = Counter(code for _, _, code in results if code not in ("OK", "DEADLINE_EXCEEDED"))
    key = f"probe_{phase}_"
    out.figures[key + "timeouts"] = timeouts
    out.figures[key + "errors"] = sum(errors.values())
    if errors:
        out.note(key + "errors", ", ".join(f"{n} {c}" for c, n in sorted(errors.items())))
    if not timed:
        for kind in ("p50_ms", "p99_ms", "max_ms"):
            out.null(key + kind, f"no probe answered or timed out in the {phase} phase")
        return
    out.figures[key + "p50_ms"] = round(percentile(timed, 0.50) or 0.0, 2)
    out.figures[key + "p99_ms"] = round(percentile(timed, 0.99) or 0.0, 2)
    out.figures[key + "max_ms"] = round(max(timed), 2)
    out.note(key + "p99_ms", f"{len(results)} probes started in the phase; a timed-out probe "
             f"counts as its {PROBE_TIMEOUT_S:g} s timeout (and in {key}timeouts)")


def _rss_figures(out: Outcome, rss: RssSampler | None, bounds: list[float]) -> None:
    keys = ("scheduler_rss_baseline_mib", "scheduler_rss_peak_during_mib",
            "scheduler_rss_after_mib")
    if rss is None:
        for key in keys:
            out.null(key, NO_PID)
        return
    baseline = rss.between(bounds[0], bounds[1])
    during = rss.between(bounds[1], bounds[2])
    after = rss.between(bounds[2], bounds[3])
    for key, values, pick, what in (
            (keys[0], baseline, statistics.median, "the median of the baseline's samples"),
            (keys[1], during, max, "the largest sample during the attack"),
            (keys[2], after, lambda v: v[-1], "the last sample of the after phase")):
        if values:
            out.figures[key] = round(pick(values), 1)
            out.note(key, f"VmRSS of pid(s) {', '.join(map(str, rss.pids))} every "
                     f"{RSS_INTERVAL_S:g} s; {what} ({len(values)} samples)")
        else:
            out.null(key, "no VmRSS sample in the phase (/proc/PID/status unreadable)")


async def run(ctx: BenchContext) -> Outcome:
    out = Outcome.empty(FIGURES)
    kind = ctx.args.attack
    size = ctx.args.attack_size or DEFAULT_SIZE[kind]
    quiet, duration = float(ctx.args.attack_quiet), float(ctx.args.attack_duration)
    pids = [pid for name, pid in ctx.stack.scheduler_pids.items()
            if name.startswith(SCHEDULER_PREFIX)]
    rss = RssSampler(pids) if pids else None
    probe = ProbeProcess(ctx.stack.grpc_addrs[0])
    await probe.start()
    if rss is not None:
        rss.start()
    bounds = [time.time()]
    try:
        ctx.log(f"attack {kind}: baseline for {quiet:g}s")
        await asyncio.sleep(quiet)
        bounds.append(time.time())
        ctx.log(f"attack {kind}: {size} for {duration:g}s")
        began = time.monotonic()
        try:
            await asyncio.wait_for(RUNNERS[kind](ctx, out, size, began + duration),
                                   duration + OVERRUN_S)
        except TimeoutError:
            out.note("attack_s", f"the attack was stopped {OVERRUN_S:g} s after its window")
        # an attack over sooner (a connection the server closed) still has its whole window:
        # the probe measures what it left behind
        await asyncio.sleep(max(0.0, began + duration - time.monotonic()))
        out.figures["attack_s"] = round(time.monotonic() - began, 1)
        bounds.append(time.time())
        ctx.log(f"attack {kind}: over after {out.figures['attack_s']}s; after for {quiet:g}s")
        await asyncio.sleep(quiet)
        bounds.append(time.time())
    finally:
        await probe.stop()
        if rss is not None:
            await rss.stop()
    for i, phase in enumerate(PHASES):
        _probe_figures(out, phase, [r for r in probe.results if bounds[i] <= r[0] < bounds[i + 1]])
    _rss_figures(out, rss, bounds)
    for key, attacks in ONLY.items():
        if kind not in attacks and out.figures.get(key) is None and key not in out.notes:
            out.null(key, f"measured by the {' and '.join(attacks)} attack(s) only")
    for key in ("attack_refused_resource_exhausted", "attack_refused_unavailable"):
        if out.figures.get(key) is None and key not in out.notes:
            out.null(key, "not counted for this attack")
    out.notes["attack"] = (f"{kind}, size {size}, against {ctx.stack.grpc_addrs[0]} (insecure); "
                           f"phases {quiet:g} s / {out.figures['attack_s']} s / {quiet:g} s")
    return out


SCENARIO = Scenario(name="attack",
                    summary="one hostile caller (--attack KIND): probe p99 and scheduler RSS "
                            "before, during and after",
                    figures=FIGURES, run=run, uses_workloads=False)
