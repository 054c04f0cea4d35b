"""Wire-contract checks for proto/persys/{control,agent}/v1."""

from __future__ import annotations

import pathlib
from datetime import datetime

import pytest
from google.protobuf import descriptor as _d
from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import given
from hypothesis import strategies as st

import proto
from handlers.api.convert import set_time
from proto import generate as proto_generate
from proto.persys.agent.v1 import agent_pb2, agent_pb2_grpc
from proto.persys.control.v1 import control_pb2, control_pb2_grpc

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

GENERATED_FILES = [
    f"proto/persys/{svc}/v1/{svc}{suffix}"
    for svc in ("control", "agent")
    for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
]


# --------------------------------------------------------------------------
# Generation is reproducible and committed output is up to date
# --------------------------------------------------------------------------


def test_regenerate_is_byte_identical(tmp_path: pathlib.Path) -> None:
    proto_generate.generate(tmp_path)
    for rel in GENERATED_FILES:
        fresh = tmp_path / rel
        committed = REPO_ROOT / rel
        assert fresh.is_file(), f"protoc did not produce {rel}"
        assert committed.is_file(), f"{rel} is not committed; run python -m proto.generate"
        assert fresh.read_bytes() == committed.read_bytes(), (
            f"{rel} is stale; run python -m proto.generate"
        )


def test_proto_package_is_ours() -> None:
    assert proto.__file__ is not None
    path = pathlib.Path(proto.__file__).resolve()
    assert path == REPO_ROOT / "proto" / "__init__.py"
    assert control_pb2.__file__ is not None
    assert pathlib.Path(control_pb2.__file__).resolve().is_relative_to(REPO_ROOT)


def test_packages_and_go_packages() -> None:
    assert control_pb2.DESCRIPTOR.package == "persys.control.v1"
    assert agent_pb2.DESCRIPTOR.package == "persys.agent.v1"
    assert (
        control_pb2.DESCRIPTOR.GetOptions().go_package
        == "github.com/persys-dev/persys/api/control/v1;controlv1"
    )
    assert (
        agent_pb2.DESCRIPTOR.GetOptions().go_package
        == "github.com/persys-dev/compute-agent/pkg/api/v1;v1"
    )


# --------------------------------------------------------------------------
# Field numbers / types (representative sample)
# --------------------------------------------------------------------------

_T = _d.FieldDescriptor
STR = _T.TYPE_STRING
BOOL = _T.TYPE_BOOL
I32 = _T.TYPE_INT32
I64 = _T.TYPE_INT64
DBL = _T.TYPE_DOUBLE
MSG = _T.TYPE_MESSAGE
ENUM = _T.TYPE_ENUM
TS = "google.protobuf.Timestamp"

# (module, message, {field: (number, type, message/enum full name or None, repeated)})
FieldSpec = tuple[int, int, str | None, bool]

FIELD_TABLE: list[tuple[object, str, dict[str, FieldSpec]]] = [
    (
        control_pb2,
        "RegisterNodeRequest",
        {
            "node_id": (1, STR, None, False),
            "capabilities": (2, MSG, "persys.control.v1.NodeCapabilities", False),
            "labels": (3, MSG, "persys.control.v1.RegisterNodeRequest.LabelsEntry", True),
            "agent_version": (4, STR, None, False),
            "grpc_endpoint": (5, STR, None, False),
            "cluster_id": (6, STR, None, False),
            "timestamp": (7, MSG, TS, False),
        },
    ),
    (
        control_pb2,
        "HeartbeatRequest",
        {
            "node_id": (1, STR, None, False),
            "usage": (2, MSG, "persys.control.v1.NodeUsage", False),
            "workload_statuses": (3, MSG, "persys.control.v1.WorkloadStatus", True),
            "timestamp": (4, MSG, TS, False),
            "workload_usage": (5, MSG, "persys.control.v1.WorkloadUsageSnapshot", True),
        },
    ),
    (
        control_pb2,
        "ApplyWorkloadRequest",
        {
            "workload_id": (1, STR, None, False),
            "spec": (2, MSG, "persys.control.v1.WorkloadSpec", False),
            "revision_id": (10, STR, None, False),
            "desired_state": (11, STR, None, False),
        },
    ),
    (
        control_pb2,
        "WorkloadSpec",
        {
            "type": (1, STR, None, False),
            "resources": (2, MSG, "persys.control.v1.ResourceRequirements", False),
            "container": (10, MSG, "persys.control.v1.ContainerSpec", False),
            "compose": (11, MSG, "persys.control.v1.ComposeSpec", False),
            "vm": (12, MSG, "persys.control.v1.VMSpec", False),
            "metadata": (20, MSG, "persys.control.v1.WorkloadSpec.MetadataEntry", True),
        },
    ),
    (
        control_pb2,
        "NodeView",
        {
            "node_id": (1, STR, None, False),
            "total_cpu_cores": (8, DBL, None, False),
            "available_memory_mb": (11, I64, None, False),
            "supported_workload_types": (12, STR, None, True),
            "taints": (14, MSG, "persys.control.v1.NodeTaint", True),
        },
    ),
    (
        control_pb2,
        "WorkloadView",
        {
            "workload_id": (1, STR, None, False),
            "retry_attempts": (7, I32, None, False),
            "failure_reason": (10, STR, None, False),
            "reason": (12, MSG, "persys.control.v1.ReasonDetail", False),
            "created_at": (14, MSG, TS, False),
        },
    ),
    (
        control_pb2,
        "SchedulerEventView",
        {
            "id": (1, STR, None, False),
            "type": (2, STR, None, False),
            "workload_id": (3, STR, None, False),
            "node_id": (4, STR, None, False),
            "reason": (5, STR, None, False),
            "timestamp": (6, MSG, TS, False),
            "details": (7, MSG, "persys.control.v1.SchedulerEventView.DetailsEntry", True),
        },
    ),
    (
        control_pb2,
        "ListEventsRequest",
        {
            "limit": (1, I64, None, False),
            "type": (2, STR, None, False),
            "workload_id": (3, STR, None, False),
            "node_id": (4, STR, None, False),
            "after_id": (100, STR, None, False),
        },
    ),
    (
        control_pb2,
        "WatchEventsRequest",
        {
            "type": (1, STR, None, False),
            "workload_id": (2, STR, None, False),
            "node_id": (3, STR, None, False),
            "after_id": (100, STR, None, False),
        },
    ),
    (
        control_pb2,
        "ApplyWorkloadResponse",
        {
            "success": (1, BOOL, None, False),
            "failure_reason": (2, ENUM, "persys.control.v1.FailureReason", False),
            "error_message": (3, STR, None, False),
        },
    ),
    (
        control_pb2,
        "BucketView",
        {
            "object_count": (7, I64, None, False),
            "created_at": (11, MSG, TS, False),
            "updated_at": (12, MSG, TS, False),
        },
    ),
    (
        control_pb2,
        "ControlMessage",
        {
            "register": (1, MSG, "persys.control.v1.RegisterNodeRequest", False),
            "heartbeat": (2, MSG, "persys.control.v1.HeartbeatRequest", False),
            "apply": (3, MSG, "persys.control.v1.ApplyWorkloadRequest", False),
            "delete": (4, MSG, "persys.control.v1.DeleteWorkloadRequest", False),
        },
    ),
    (
        agent_pb2,
        "ApplyWorkloadRequest",
        {
            "id": (1, STR, None, False),
            "type": (2, ENUM, "persys.agent.v1.WorkloadType", False),
            "revision_id": (3, STR, None, False),
            "desired_state": (4, ENUM, "persys.agent.v1.DesiredState", False),
            "spec": (5, MSG, "persys.agent.v1.WorkloadSpec", False),
        },
    ),
    (
        agent_pb2,
        "WorkloadStatus",
        {
            "id": (1, STR, None, False),
            "type": (2, ENUM, "persys.agent.v1.WorkloadType", False),
            "revision_id": (3, STR, None, False),
            "desired_state": (4, ENUM, "persys.agent.v1.DesiredState", False),
            "actual_state": (5, ENUM, "persys.agent.v1.ActualState", False),
            "message": (6, STR, None, False),
            "created_at": (7, I64, None, False),
            "updated_at": (8, I64, None, False),
            "metadata": (9, MSG, "persys.agent.v1.WorkloadStatus.MetadataEntry", True),
            "usage": (10, MSG, "persys.agent.v1.WorkloadUsageSnapshot", False),
        },
    ),
    (
        agent_pb2,
        "VMSpec",
        {
            "vcpus": (2, I32, None, False),
            "cloud_init": (6, STR, None, False),
            "cloud_init_config": (8, MSG, "persys.agent.v1.CloudInitConfig", False),
            "managed_volumes": (9, MSG, "persys.agent.v1.ManagedVolumeSpec", True),
            "os_image": (10, STR, None, False),
            "disk_gb": (11, I64, None, False),
            "runtime": (12, STR, None, False),
        },
    ),
    (
        agent_pb2,
        "WorkloadUsageSnapshot",
        {
            "type": (2, ENUM, "persys.agent.v1.WorkloadType", False),
            "collected_at": (9, I64, None, False),
        },
    ),
]


@pytest.mark.parametrize(
    ("module", "message", "fields"),
    FIELD_TABLE,
    ids=[f"{m.__name__.rsplit('.', 1)[-1]}.{name}" for m, name, _ in FIELD_TABLE],  # type: ignore[attr-defined]
)
def test_field_numbers(module: object, message: str, fields: dict[str, FieldSpec]) -> None:
    desc = module.DESCRIPTOR.message_types_by_name[message]  # type: ignore[attr-defined]
    for name, (number, ftype, type_name, repeated) in fields.items():
        fd = desc.fields_by_name.get(name)
        assert fd is not None, f"{message}.{name} missing"
        assert fd.number == number, f"{message}.{name}: number {fd.number} != {number}"
        assert fd.type == ftype, f"{message}.{name}: type {fd.type} != {ftype}"
        is_repeated = bool(fd.is_repeated)
        assert is_repeated == repeated, f"{message}.{name}: repeated={is_repeated}"
        if ftype == MSG:
            assert fd.message_type.full_name == type_name
            is_map = fd.message_type.GetOptions().map_entry
            assert is_map == type_name.endswith("Entry"), f"{message}.{name}: map={is_map}"
        elif ftype == ENUM:
            assert fd.enum_type.full_name == type_name


def test_register_node_request_has_exactly_seven_fields() -> None:
    desc = control_pb2.RegisterNodeRequest.DESCRIPTOR
    assert sorted(f.number for f in desc.fields) == [1, 2, 3, 4, 5, 6, 7]


def test_agent_workload_status_has_fields_1_to_10() -> None:
    desc = agent_pb2.WorkloadStatus.DESCRIPTOR
    assert sorted(f.number for f in desc.fields) == list(range(1, 11))


def test_oneofs() -> None:
    ws = control_pb2.WorkloadSpec.DESCRIPTOR.oneofs_by_name["workload"]
    assert [f.name for f in ws.fields] == ["container", "compose", "vm"]
    cm = control_pb2.ControlMessage.DESCRIPTOR.oneofs_by_name["message"]
    assert [f.name for f in cm.fields] == ["register", "heartbeat", "apply", "delete"]
    aws = agent_pb2.WorkloadSpec.DESCRIPTOR.oneofs_by_name["spec"]
    assert [(f.name, f.number) for f in aws.fields] == [("container", 1), ("compose", 2), ("vm", 3)]


def test_enums() -> None:
    assert {v.name: v.number for v in control_pb2.FailureReason.DESCRIPTOR.values} == {
        "FAILURE_REASON_UNSPECIFIED": 0,
        "IMAGE_PULL_FAILED": 1,
        "IMAGE_NOT_FOUND": 2,
        "INSUFFICIENT_RESOURCES": 3,
        "INVALID_SPEC": 4,
        "RUNTIME_ERROR": 5,
        "NETWORK_ERROR": 6,
        "STORAGE_ERROR": 7,
        "VM_BOOT_FAILED": 8,
    }
    assert {v.name: v.number for v in control_pb2.AutomationActionType.DESCRIPTOR.values} == {
        "AUTOMATION_ACTION_TYPE_UNSPECIFIED": 0,
        "AUTOMATION_ACTION_SET_DESIRED_STATE": 1,
        "AUTOMATION_ACTION_RETRY_WORKLOAD": 2,
        "AUTOMATION_ACTION_DELETE_WORKLOAD": 3,
        "AUTOMATION_ACTION_SCALE_REPLICAS": 4,
    }
    assert [(v.name, v.number) for v in agent_pb2.WorkloadType.DESCRIPTOR.values] == [
        ("WORKLOAD_TYPE_UNSPECIFIED", 0),
        ("WORKLOAD_TYPE_CONTAINER", 1),
        ("WORKLOAD_TYPE_COMPOSE", 2),
        ("WORKLOAD_TYPE_VM", 3),
        ("WORKLOAD_TYPE_MICROVM", 4),
    ]
    assert [v.number for v in agent_pb2.DesiredState.DESCRIPTOR.values] == [0, 1, 2]
    assert [v.number for v in agent_pb2.ActualState.DESCRIPTOR.values] == [0, 1, 2, 3, 4, 5]


def test_after_id_extension_roundtrip() -> None:
    # after_id=100 is our additive extension (absent from the Go proto).
    req = control_pb2.ListEventsRequest(limit=5, type="NodeLost", after_id="abc")
    back = control_pb2.ListEventsRequest.FromString(req.SerializeToString())
    assert (back.limit, back.type, back.after_id) == (5, "NodeLost", "abc")


# --------------------------------------------------------------------------
# Services
# --------------------------------------------------------------------------

UNARY = "unary_unary"
SERVER_STREAM = "unary_stream"
BIDI = "stream_stream"

EXPECTED_CONTROL_METHODS = [
    ("RegisterNode", UNARY),
    ("Heartbeat", UNARY),
    ("ApplyWorkload", UNARY),
    ("DeleteWorkload", UNARY),
    ("RetryWorkload", UNARY),
    ("DrainNode", UNARY),
    ("UndrainNode", UNARY),
    ("TaintNode", UNARY),
    ("UntaintNode", UNARY),
    ("SetNodeLabel", UNARY),
    ("DeleteNodeLabel", UNARY),
    ("SubmitAutomationSuggestion", UNARY),
    ("ListNodes", UNARY),
    ("GetNode", UNARY),
    ("ListWorkloads", UNARY),
    ("GetWorkload", UNARY),
    ("GetClusterSummary", UNARY),
    ("ListEvents", UNARY),
    ("WatchEvents", SERVER_STREAM),
    ("ControlStream", BIDI),
    ("CreateDisk", UNARY),
    ("ListDisks", UNARY),
    ("GetDisk", UNARY),
    ("DeleteDisk", UNARY),
    ("CreateBucket", UNARY),
    ("ListBuckets", UNARY),
    ("GetBucket", UNARY),
    ("DeleteBucket", UNARY),
    ("GetBucketAccess", UNARY),
    ("ListBucketObjects", UNARY),
    ("ExplainPlacement", UNARY),
]

EXPECTED_AGENT_METHODS = [
    ("ApplyWorkload", UNARY),
    ("DeleteWorkload", UNARY),
    ("GetWorkloadStatus", UNARY),
    ("ListWorkloads", UNARY),
    ("HealthCheck", UNARY),
    ("ListActions", UNARY),
]


def _kind(m: _d.MethodDescriptor) -> str:
    return {
        (False, False): UNARY,
        (False, True): SERVER_STREAM,
        (True, False): "stream_unary",
        (True, True): BIDI,
    }[(m.client_streaming, m.server_streaming)]


@pytest.mark.parametrize(
    ("module", "service", "expected"),
    [
        (control_pb2, "AgentControl", EXPECTED_CONTROL_METHODS),
        (agent_pb2, "AgentService", EXPECTED_AGENT_METHODS),
    ],
    ids=["control", "agent"],
)
def test_service_methods(module: object, service: str, expected: list[tuple[str, str]]) -> None:
    svc = module.DESCRIPTOR.services_by_name[service]  # type: ignore[attr-defined]
    assert [(m.name, _kind(m)) for m in svc.methods] == expected


def test_method_io_types() -> None:
    svc = control_pb2.DESCRIPTOR.services_by_name["AgentControl"]
    by_name = {m.name: m for m in svc.methods}
    assert by_name["WatchEvents"].input_type.name == "WatchEventsRequest"
    assert by_name["WatchEvents"].output_type.name == "SchedulerEventView"
    assert by_name["ControlStream"].input_type.name == "ControlMessage"
    assert by_name["ControlStream"].output_type.name == "ControlMessage"
    for m in svc.methods:
        if m.name in ("WatchEvents", "ControlStream"):
            continue
        assert m.input_type.name == f"{m.name}Request"
        assert m.output_type.name == f"{m.name}Response"
    for m in agent_pb2.DESCRIPTOR.services_by_name["AgentService"].methods:
        assert m.input_type.name == f"{m.name}Request"
        assert m.output_type.name == f"{m.name}Response"


def test_grpc_stubs_exist() -> None:
    assert hasattr(control_pb2_grpc, "AgentControlStub")
    assert hasattr(control_pb2_grpc, "AgentControlServicer")
    assert hasattr(control_pb2_grpc, "add_AgentControlServicer_to_server")
    assert hasattr(agent_pb2_grpc, "AgentServiceStub")
    assert hasattr(agent_pb2_grpc, "AgentServiceServicer")
    assert hasattr(agent_pb2_grpc, "add_AgentServiceServicer_to_server")


# --------------------------------------------------------------------------
# Timestamps: our integer conversion equals protobuf's FromDatetime


@given(moment=st.datetimes(min_value=datetime(1900, 1, 1), max_value=datetime(2300, 1, 1),
                           timezones=st.none() | st.timezones()))
def test_set_time_equals_from_datetime(moment: datetime) -> None:
    ours, theirs = Timestamp(), Timestamp()
    set_time(ours, moment)
    theirs.FromDatetime(moment)
    assert (ours.seconds, ours.nanos) == (theirs.seconds, theirs.nanos)
