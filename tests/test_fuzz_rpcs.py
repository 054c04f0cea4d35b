"""Property-based fuzzing of every AgentControl RPC against a real stack (etcd, Redis, the
scheduler, two simulated agents): Hypothesis builds requests from each method's message
descriptor (hostile strings, extreme numbers, unknown enum values, nested messages, maps) and
raw malformed bodies. Every answer is a gRPC status other than UNKNOWN/INTERNAL/DATA_LOSS or an
in-band answer, nothing logs a traceback, and etcd is audited afterwards: every key under a
known prefix, every spec with its status, allocations equal to the sum of assignments and
within capacity."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eventsource.etcd import AsyncEtcd
from ops.replay import check_invariants, rebuild_cluster
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import make_settings, running_fleet, running_scheduler
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.slow

#: requests per run (PERSYS_FUZZ_EXAMPLES for a longer one)
EXAMPLES = int(os.environ.get("PERSYS_FUZZ_EXAMPLES", "400"))

SERVICE = pb.DESCRIPTOR.services_by_name["AgentControl"]
#: every method but ControlStream (a stream of requests, unimplemented as in Go)
METHODS = [m for m in SERVICE.methods if not m.client_streaming]
#: answers that mean the server failed, not the request
FAILURES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS}
#: the top-level etcd paths the scheduler writes (eventsource/keys.py)
KNOWN = ("/nodes/", "/workloads-spec/", "/workloads-status/", "/workloads/", "/assignments/",
         "/retries/", "/drifts/", "/volumes/", "/health", "/allocations/", "/persys/scheduler/",
         "/skydns/")

HOSTILE = st.sampled_from([
    "", " ", "\x00", "a\nb", "..", "../../etc/passwd", "/data", "relative", "\u202egnp.exe",
    "x" * 300, "scheduler_shard", "127.0.0.1:1", "[::1]:80", "a\x00b:1", "host..x:1",
    "sim-node-00001", "sim-node-00002", "w1", "w2", "container", "vm", "compose", "local",
    "ceph_rbd", "nfs", "Running", "Deleted", "Stopped", "NoSchedule", "PreferNoSchedule",
    "ReadWriteOnce", "Retain", "ext4", "busybox:1", "1-0", "99999999999999-0", "-1",
    "y" * 70_000])
TEXT = st.one_of(HOSTILE, st.text(max_size=40), st.text(alphabet=st.characters(
    codec="utf-8"), max_size=400))
RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    edges = [v for v in (0, 1, -1, 64, 4000, 2**31 - 1, -(2**31), 2**62, 2**63 - 1, -(2**63))
             if low <= v <= high]
    return st.one_of(st.sampled_from(edges), st.integers(low, high))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t == FieldDescriptor.TYPE_STRING:
        return TEXT
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=300)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.floats(width=32 if t == FieldDescriptor.TYPE_FLOAT else 64)
    if t == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-5, 50))  # open enums
    low, high = RANGES[t]
    return _integers(low, high)


def _is_map(field: FieldDescriptor) -> bool:
    return (field.type == FieldDescriptor.TYPE_MESSAGE
            and field.message_type.GetOptions().map_entry)


def fields_of(descriptor: Descriptor, depth: int) -> st.SearchStrategy[dict[str, Any]]:
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if _is_map(field):
            key = _scalar(field.message_type.fields_by_name["key"])
            value_field = field.message_type.fields_by_name["value"]
            if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                if depth <= 0:
                    continue
                value: st.SearchStrategy[Any] = fields_of(value_field.message_type, depth - 1)
            else:
                value = _scalar(value_field)
            optional[field.name] = st.dictionaries(key, value, max_size=4)
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth <= 0:
                continue
            one: st.SearchStrategy[Any] = fields_of(field.message_type, depth - 1)
        else:
            one = _scalar(field)
        repeated = field.is_repeated
        optional[field.name] = st.lists(one, max_size=3) if repeated else one
    return st.fixed_dictionaries({}, optional=optional)


def fill(message: Message, values: dict[str, Any]) -> None:
    descriptor = message.DESCRIPTOR
    for name, value in values.items():
        field = descriptor.fields_by_name[name]
        target = getattr(message, name)
        if _is_map(field):
            value_field = field.message_type.fields_by_name["value"]
            for k, v in value.items():
                if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                    fill(target[k], v)
                else:
                    target[k] = v
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.is_repeated:
                for v in value:
                    fill(target.add(), v)
            else:
                target.SetInParent()
                fill(target, value)
        elif field.is_repeated:
            target.extend(value)
        else:
            setattr(message, name, value)


def request_bytes(method: Any, values: dict[str, Any]) -> bytes:
    message = GetMessageClass(method.input_type)()
    try:
        fill(message, values)
    except (ValueError, TypeError, OverflowError):
        pass  # a value the field does not take (e.g. a float out of range): sent as far as set
    return message.SerializeToString()


CALLS = st.one_of(
    st.sampled_from(METHODS).flatmap(lambda m: st.tuples(
        st.just(m), fields_of(m.input_type, 2).map(lambda v, m=m: request_bytes(m, v)))),
    st.tuples(st.sampled_from(METHODS), st.one_of(
        st.binary(max_size=200), st.sampled_from([b"\xff", b"\x0a\xff\xff\xff\xff\x0f",
                                                  b"\x08" + b"\xff" * 11, b"\x12\x05ab"]))),
)


async def _call(channel: grpc.aio.Channel, method: Any, body: bytes) -> str:
    path = f"/{SERVICE.full_name}/{method.name}"
    try:
        if method.server_streaming:
            stream = channel.unary_stream(path)(body, timeout=0.3)
            seen = 0
            async for _ in stream:
                seen += 1
                if seen >= 3:
                    stream.cancel()
                    break
        else:
            await channel.unary_unary(path)(body, timeout=10)
    except grpc.aio.AioRpcError as exc:
        if exc.code() in FAILURES:
            return f"{method.name}: {exc.code().name} {exc.details()!r}"
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not method.server_streaming:
            return f"{method.name}: DEADLINE_EXCEEDED {exc.details()!r}"
    except asyncio.CancelledError:
        pass
    return ""


async def test_fuzzed_rpcs_answer_and_leave_consistent_state(
        etcd_server, redis_server, key_root, stream_key, caplog) -> None:
    caplog.set_level(logging.WARNING)
    s = make_settings(etcd_server, redis_server, key_root, stream_key,
                      reconcile_interval_s=2.0)
    async with running_scheduler(s) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        async with running_fleet(address, 2) as fleet:
            await fleet.wait_registered()
            await wait_for(lambda: sched.leader.is_leader, timeout=15, message="leader")
            loop = asyncio.get_running_loop()
            channel = grpc.aio.insecure_channel(address)
            problems: list[str] = []
            calls: list[str] = []
            try:
                @settings(max_examples=EXAMPLES, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(CALLS)
                def one(call: tuple[Any, bytes]) -> None:
                    method, body = call
                    calls.append(method.name)
                    problem = asyncio.run_coroutine_threadsafe(
                        _call(channel, method, body), loop).result(timeout=30)
                    if problem:
                        problems.append(problem)

                await asyncio.to_thread(one)
            finally:
                await channel.close()
            assert not problems, problems[:10]
            assert len(calls) >= EXAMPLES
            assert len(set(calls)) == len(METHODS), sorted(
                {m.name for m in METHODS} - set(calls))
            # the scheduler still answers
            await sched.cluster.wait_for(await sched.etcd.current_revision(), timeout=10)

        tracebacks = [r for r in caplog.records if r.exc_info]
        assert not tracebacks, [(r.name, r.getMessage()) for r in tracebacks[:5]]

        # the audit: what etcd holds after the fuzzing
        etcd = AsyncEtcd([etcd_server.endpoint])
        try:
            kvs, _ = await etcd.list_prefix(key_root + "/")
            stray = [kv.key for kv in kvs
                     if not any(kv.key.startswith(key_root + p) for p in KNOWN)]
            assert not stray, stray[:10]
            cluster = await rebuild_cluster(etcd, sched.layout)
            without_status = sorted(set(cluster.specs.items) - set(cluster.statuses.items))
            assert not without_status, without_status[:10]
            assert check_invariants(cluster) == []
        finally:
            etcd.close()
