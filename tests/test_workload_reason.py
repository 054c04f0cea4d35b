"""The agent's ReasonDetail (heartbeat ``WorkloadStatus.reason``) reaches ``WorkloadView.reason``,
as the Go version's ``UpdateWorkloadRuntimeDetails`` kept it in ``statusInfo.reason``; the
same reason again (even with a newer ``last_transition``) writes nothing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from google.protobuf.timestamp_pb2 import Timestamp

from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import (
    container_spec,
    control_stub,
    make_settings,
    running_fleet,
    running_scheduler,
)
from tests.fixtures.waiting import wait_for


def _stamp(moment: datetime) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(moment)
    return ts


async def test_heartbeat_reason_detail_reaches_workload_view_reason(
        etcd_server, redis_server, key_root, stream_key):
    s = make_settings(etcd_server, redis_server, key_root, stream_key,
                      reconcile_interval_s=3600.0)
    async with running_scheduler(s) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        async with running_fleet(address, 1, heartbeat_interval_s=3600) as fleet, \
                control_stub(address) as stub:
            await fleet.wait_registered()
            assert (await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id="w-reason", spec=container_spec()))).success
            await wait_for(lambda: "w-reason" in fleet.nodes[0].workload_ids())
            node_id = fleet.nodes[0].node_id
            now = datetime.now(UTC).replace(microsecond=0)
            retry_at = now + timedelta(seconds=30)

            def heartbeat(moment: datetime, state: str = "Failed",
                          code: str = "ImagePullFailed") -> pb.HeartbeatRequest:
                return pb.HeartbeatRequest(
                    node_id=node_id, timestamp=_stamp(moment),
                    workload_statuses=[pb.WorkloadStatus(
                        workload_id="w-reason", state=state,
                        failure_reason=pb.IMAGE_PULL_FAILED,
                        message="pull access denied for nginx:1",
                        last_transition=_stamp(moment),
                        reason=pb.ReasonDetail(code=code, message="pull access denied",
                                               retryable=True, last_transition=_stamp(moment),
                                               next_retry_at=_stamp(retry_at)))])

            assert (await stub.Heartbeat(heartbeat(now))).acknowledged
            await wait_for(lambda: sched.cluster.statuses.get("w-reason").value.status
                           == "Failed")

            async def reason() -> pb.ReasonDetail | None:
                view = (await stub.GetWorkload(
                    pb.GetWorkloadRequest(workload_id="w-reason"))).workload
                return view.reason if view.reason.code else None

            got = await wait_for(reason, timeout=3, message="WorkloadView.reason filled")
            assert got.code == "ImagePullFailed"
            assert got.message == "pull access denied"
            assert got.retryable
            assert got.last_transition.ToDatetime(tzinfo=UTC) == now
            assert got.next_retry_at.ToDatetime(tzinfo=UTC) == retry_at
            listed = (await stub.ListWorkloads(pb.ListWorkloadsRequest())).workloads
            assert [w.reason.code for w in listed if w.workload_id == "w-reason"] == [
                "ImagePullFailed"]
            stored = sched.cluster.statuses.get("w-reason")
            assert stored.value.status_info.reason is not None
            assert stored.value.status_info.reason.last_transition == now.isoformat().replace(
                "+00:00", "Z")

            # the same reason and state, a newer last_transition: nothing to write
            revision = stored.mod_revision
            later = now + timedelta(seconds=5)
            assert (await stub.Heartbeat(heartbeat(later))).acknowledged
            assert sched.cluster.statuses.get("w-reason").mod_revision == revision

            # a new reason with the same state is written, though state and message are old
            assert (await stub.Heartbeat(heartbeat(later, code="ImageNotFound"))).acknowledged
            await wait_for(lambda: sched.cluster.statuses.get("w-reason").value.status_info
                           .reason.code == "ImageNotFound", timeout=3,
                           message="the changed reason recorded")
