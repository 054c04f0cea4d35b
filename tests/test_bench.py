"""``persys-scheduler bench``: the JSON contract of docs/benchmark.md, end to end, at tiny sizes.

Each scenario runs as an operator runs it (a subprocess of ``persys-scheduler bench ... --json``
starting its own etcd, Redis, scheduler and simulated fleet); the test reads the last line of
its output. The pure pieces (Prometheus text, quantiles, key grouping) are tested directly.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from ops.bench import apply_defaults
from ops.benchlib.etcdwatch import key_group
from ops.benchlib.fleetstats import merge_fleet_stats
from ops.benchlib.promtext import MetricsSnapshot
from ops.benchlib.quantiles import bucket_quantile, percentile
from ops.benchlib.registry import SCENARIOS
from ops.benchlib.stack import Stack, StackOptions
from ops.benchlib.stages import describe_stages, describe_storage
from ops.cli import build_parser
from proto.persys.control.v1 import control_pb2, control_pb2_grpc
from tests.fixtures.waiting import wait_for_sync

ROOT = Path(__file__).resolve().parent.parent

#: docs/benchmark.md, "The scenarios and their figures" (exact keys).
BENCH_FIGURES = {
    "place": {"placements_per_s", "apply_latency_p50_ms", "apply_latency_p99_ms",
              "decision_p99_ms", "etcd_txns_per_placement", "nodes_over_capacity", "rejected",
              "etcd_writes_per_placement", "scheduler_cpu_ms_per_placement",
              "scheduler_peak_rss_mib"},
    "reconcile": {"cycle_time_p50_ms", "cycle_time_p99_ms", "agent_rpcs_per_cycle",
                  "etcd_writes_per_cycle", "heartbeat_etcd_writes_per_s", "scheduler_rss_mib",
                  "scheduler_peak_rss_mib"},
    "churn": {"killed", "recovery_s", "agent_rpcs_during_recovery", "scheduler_peak_rss_mib"},
    "events": {"events", "watchers", "event_latency_p50_ms", "event_latency_p99_ms",
               "events_lost", "events_duplicated", "scheduler_cpu_ms_per_event",
               "scheduler_peak_rss_mib"},
    "failover": {"kills", "failover_p50_s", "failover_p99_s", "stale_leader_writes",
                 "double_applies", "scheduler_peak_rss_mib"},
}
TOP_KEYS = {"scenario", "nodes", "workloads", "replicas", "figures", "notes"}
#: Short intervals so that steady state, cycles and recovery happen within seconds.
FAST = ["--nodes", "5", "--workloads", "20", "--replicas", "1", "--heartbeat-interval", "1",
        "--reconcile-interval", "1"]


def run_bench(*args: str, limit_s: float = 60.0) -> tuple[dict, float]:
    began = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ops.cli", "bench", *args, "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=limit_s + 30, check=False)
    elapsed = time.monotonic() - began
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    last = proc.stdout.strip().splitlines()[-1]
    return json.loads(last), elapsed


def check_contract(result: dict, scenario: str, workloads: int = 20) -> None:
    assert set(result) == TOP_KEYS
    assert result["scenario"] == scenario
    assert (result["nodes"], result["workloads"], result["replicas"]) == (5, workloads, 1)
    assert set(result["figures"]) == BENCH_FIGURES[scenario]
    for key, value in result["figures"].items():
        if value is None:
            assert result["notes"].get(key), f"{key} is null without a reason"
        else:
            assert isinstance(value, int | float), key
            assert not isinstance(value, bool), key
            assert math.isfinite(value), key
    assert all(isinstance(v, str) for v in result["notes"].values())


@pytest.mark.timeout(120)
def test_place_contract_and_no_node_over_capacity():
    result, elapsed = run_bench("place", *FAST, "--clients", "4")
    check_contract(result, "place")
    figures = result["figures"]
    assert figures["nodes_over_capacity"] == 0
    assert figures["rejected"] == 0, result["notes"]
    assert figures["placements_per_s"] > 0
    assert figures["apply_latency_p50_ms"] <= figures["apply_latency_p99_ms"]
    # the bench started the scheduler, so it knows its pid: CPU and memory are measured
    assert figures["scheduler_cpu_ms_per_placement"] > 0
    # counted from the bench's own etcd watch: a spec and a status key per placement at least
    assert figures["etcd_writes_per_placement"] >= 2, result["notes"]
    assert "workload spec 1" in result["notes"]["etcd_writes_per_placement"]
    assert "of scheduler CPU" in result["notes"]["scheduler_cpu_ms_per_placement"]
    assert figures["scheduler_peak_rss_mib"] > 10
    assert elapsed < 60


@pytest.mark.timeout(120)
def test_events_contract_says_where_the_delivery_time_went():
    """Besides its figures, the run tells which stage an event's time went to and how the
    disk under etcd behaved, so a missed latency target can be traced to its cause."""
    result, _ = run_bench("events", *FAST[:2], "--replicas", "1", "--watchers", "3",
                          "--rate", "20")
    check_contract(result, "events", workloads=0)
    figures, notes = result["figures"], result["notes"]
    assert figures["events"] == 200
    assert figures["watchers"] == 3
    assert figures["events_lost"] == 0
    assert figures["events_duplicated"] == 0
    assert figures["scheduler_cpu_ms_per_event"] > 0
    assert figures["scheduler_peak_rss_mib"] > 10
    assert re.search(r"SetNodeLabel as the client saw it .* p50 [\d.]+ p99 [\d.]+ ms",
                     notes["stages"])
    assert re.search(r"decision to stream append \(relay\) p50 [\d.]+ p99 [\d.]+ ms",
                     notes["stages"])
    assert re.search(r"hand-over to the watcher's stream p50 [\d.]+ p99 [\d.]+ ms",
                     notes["stages"])
    assert re.search(r"etcd WAL fsyncs during the run: [1-9]\d*, p99 [\d.]+ ms",
                     notes["storage"])


@pytest.mark.timeout(120)
def test_reconcile_contract_with_the_fleet_in_two_processes():
    result, elapsed = run_bench("reconcile", *FAST, "--cycles", "6", "--sim-processes", "2")
    check_contract(result, "reconcile")
    assert result["figures"]["scheduler_rss_mib"] > 0
    assert result["figures"]["heartbeat_etcd_writes_per_s"] is not None
    # both halves of the fleet answered the cycles and their counters were summed
    assert "sim-0" in result["notes"]["cpu"]
    assert "sim-1" in result["notes"]["cpu"]
    assert result["figures"]["agent_rpcs_per_cycle"] == pytest.approx(5, abs=0.5)
    counted = re.search(r"the agents themselves counted ([0-9.]+) per cycle",
                        result["notes"]["agent_rpcs_per_cycle"])
    assert counted is not None, result["notes"]
    # the agents' span may be off by one cycle at each end (their counters are read just
    # after the metrics scrape), so over 6 cycles the five nodes give 4.2-5.8 per cycle, and
    # one process's three nodes alone at most 3.5
    assert 4.0 < float(counted.group(1)) < 6.0, result["notes"]["agent_rpcs_per_cycle"]
    assert elapsed < 60


@pytest.mark.timeout(180)
def test_failover_with_a_paused_leader_counts_its_writes_after_the_takeover():
    """--fault pause: the leader is SIGSTOPped past its lease, a standby takes over, the old
    leader is resumed alone; the bench's etcd watch counts what it writes then (none) and the
    agents count applies under an older term (none). With --fault kill the count is null with
    its reason."""
    result, elapsed = run_bench("failover", "--nodes", "5", "--workloads", "20",
                                "--heartbeat-interval", "1", "--reconcile-interval", "1",
                                "--lease-ttl", "3", "--kills", "2", "--fault", "pause",
                                limit_s=120)
    figures, notes = result["figures"], result["notes"]
    assert set(figures) == BENCH_FIGURES["failover"]
    assert result["replicas"] == 2
    assert figures["kills"] == 2
    assert figures["stale_leader_writes"] == 0, notes
    assert figures["double_applies"] == 0
    assert "resumed old leader" in notes["stale_leader_writes"]
    # stopped past a 3 s lease: the takeover cannot be quicker than the lease's expiry
    assert 1.0 < figures["failover_p50_s"] <= figures["failover_p99_s"] < 15, figures
    assert figures["scheduler_peak_rss_mib"] > 10
    assert elapsed < 120


@pytest.mark.timeout(150)
def test_failover_with_a_killed_leader_says_why_it_cannot_count_stale_writes():
    result, _ = run_bench("failover", "--nodes", "5", "--workloads", "20",
                          "--heartbeat-interval", "1", "--reconcile-interval", "1",
                          "--lease-ttl", "3", "--kills", "1", limit_s=120)
    figures, notes = result["figures"], result["notes"]
    assert figures["kills"] == 1
    assert figures["stale_leader_writes"] is None
    assert "a SIGKILLed leader cannot write" in notes["stale_leader_writes"]
    assert "--fault pause" in notes["stale_leader_writes"]
    assert figures["double_applies"] == 0
    assert figures["scheduler_peak_rss_mib"] > 10


@pytest.mark.timeout(120)
def test_churn_contract():
    result, elapsed = run_bench("churn", *FAST, "--recovery-timeout", "15")
    check_contract(result, "churn")
    assert result["figures"]["killed"] == 2  # 10% of 20
    assert elapsed < 60


@pytest.mark.parametrize("attack", [("resets", "500"), ("watchers", "20"),
                                    ("nonreading-window", "2")])
def test_attack_contract_and_the_probe_ran(attack: tuple[str, str]) -> None:
    kind, size = attack
    result, _ = run_bench("attack", "--attack", kind, "--attack-size", size, "--nodes", "3",
                          "--heartbeat-interval", "1", "--attack-duration", "2",
                          "--attack-quiet", "2", "--attack-requests", "5")
    assert set(result) == TOP_KEYS
    assert (result["scenario"], result["workloads"]) == ("attack", 0)
    assert set(result["figures"]) == set(SCENARIOS["attack"].figures)
    figures, notes = result["figures"], result["notes"]
    for key, value in figures.items():
        assert value is not None or notes.get(key), f"{key} is null without a reason"
    for phase in ("baseline", "during", "after"):  # the probe answered in every phase
        assert figures[f"probe_{phase}_p99_ms"] is not None, notes
        assert figures[f"probe_{phase}_timeouts"] == 0 or notes
    assert figures["attack_size"] == int(size)
    assert figures["scheduler_rss_peak_during_mib"] is not None  # the bench started it: pid known
    if kind == "resets":
        assert figures["attack_goaways"] is not None
    elif kind == "watchers":
        assert figures["attack_watchers_open"] is not None
    else:  # 2 callers x 5 answers of 3 nodes: far below every limit, and within the window
        assert figures["attack_streams_open"] is not None
        assert figures["attack_refused_resource_exhausted"] == 0
        assert figures["attack_goaways"] == 0
        assert figures["list_nodes_answer_kib"] is not None
        assert "x 0" in notes["attack_refused_resource_exhausted"]  # grpc-status 0, decoded


def test_the_attack_header_decoder_reads_what_hpack_encodes() -> None:
    from hpack import Encoder  # the h2 library's, a test dependency
    from hpack.table import HeaderTable

    from ops.benchlib.h2raw import STATIC_TABLE, HeaderDecoder

    assert tuple(HeaderTable.STATIC_TABLE) == STATIC_TABLE
    encoder, decoder = Encoder(), HeaderDecoder()
    for i in range(200):  # growing values: the dynamic table evicts
        fields = [(":status", "200"), ("content-type", "application/grpc"),
                  ("grpc-status", str(i % 17)), ("grpc-message", "m" * (i % 40)),
                  (f"x-{i}", "v" * i)]
        decoded = decoder.decode(encoder.encode(fields, huffman=False))
        assert decoded == [(n.encode(), v.encode()) for n, v in fields]
    coded = HeaderDecoder().decode(Encoder().encode([("grpc-message", "resource")]))
    assert coded == [(None, None)]  # name and value Huffman-coded: not decoded, said so


def test_attack_needs_its_kind(capsys) -> None:
    from ops.bench import cmd_bench

    args = build_parser().parse_args(["bench", "attack"])
    assert cmd_bench(args) == 2
    assert "--attack KIND" in capsys.readouterr().err
    args = build_parser().parse_args(["bench", "place", "--attack", "resets"])
    assert cmd_bench(args) == 2


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_run_stops_everything_it_started(signum):
    # Ctrl-C reaches a bench started from a terminal, whose SIGINT is at its default. A test
    # runner started in the background has SIGINT ignored, and an ignored signal stays ignored
    # in every child (a handled one is reset to the default), so the bench would never see it:
    # start the bench while this process handles SIGINT.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "bench", "reconcile", *FAST, "--workloads", "2000"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # blocks until the bench reports that it is applying
            if "applying" in line:
                break
        children = _children(proc.pid)
        assert len(children) >= 4  # etcd, redis, scheduler, simulator
        proc.send_signal(signum)
        rest = proc.communicate(timeout=60)[1]
        assert proc.returncode in (130, 143), rest
        assert "everything it started is stopped" in rest
        assert [pid for pid in children if _alive(pid)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_misuse_is_refused_without_starting_anything(capsys):
    args = build_parser().parse_args(["bench", "place", "--metrics", "127.0.0.1:1"])
    assert args.func(args) == 2
    assert "--metrics needs --scheduler" in capsys.readouterr().err


# -- pure pieces ---------------------------------------------------------------------------------

METRICS = """\
# HELP persys_scheduler_etcd_txns_total etcd transactions
# TYPE persys_scheduler_etcd_txns_total counter
persys_scheduler_etcd_txns_total{kind="placement",result="committed"} 10.0
persys_scheduler_etcd_txns_total{kind="placement",result="conflict"} 2.0
persys_scheduler_etcd_txns_total{kind="dispatch",result="committed"} 5.0
# TYPE persys_scheduler_agent_rpcs_total counter
# TYPE persys_scheduler_reconcile_cycle_seconds histogram
persys_scheduler_reconcile_cycle_seconds_bucket{le="0.1"} 1.0
persys_scheduler_reconcile_cycle_seconds_bucket{le="1.0"} 3.0
persys_scheduler_reconcile_cycle_seconds_bucket{le="+Inf"} 4.0
persys_scheduler_reconcile_cycle_seconds_sum 5.5
persys_scheduler_reconcile_cycle_seconds_count 4.0
odd_metric{label="a \\"quoted\\" value"} 1
"""


def test_the_fleet_is_spread_over_shard_replicas() -> None:
    # both fleets (the sim process and churn's in-process one) take this target; the
    # in-process one once took only the first replica's address
    addrs = ["127.0.0.1:1", "127.0.0.1:2"]
    shards = Stack(StackOptions(nodes=4, replicas=2, ha="shards", scheduler_addrs=addrs))
    failover = Stack(StackOptions(nodes=4, replicas=2, ha="failover", scheduler_addrs=addrs))
    try:
        assert shards._fleet_target() == "127.0.0.1:1,127.0.0.1:2"
        assert failover._fleet_target() == "127.0.0.1:1"
    finally:
        for stack in (shards, failover):
            shutil.rmtree(stack.workdir, ignore_errors=True)


@pytest.mark.parametrize(("nodes", "asked", "parts"), [
    (5, 0, [(1, 5)]),
    (2500, 0, [(1, 2500)]),
    (5000, 0, [(1, 2500), (2501, 2500)]),
    (5001, 0, [(1, 1667), (1668, 1667), (3335, 1667)]),
    (5, 2, [(1, 3), (4, 2)]),
    (2, 5, [(1, 1), (2, 1)]),
])
def test_the_fleet_is_split_into_disjoint_ranges(nodes: int, asked: int,
                                                 parts: list[tuple[int, int]]) -> None:
    assert StackOptions(nodes=nodes, sim_processes=asked).fleet_parts() == parts


def test_failover_keeps_the_fleet_in_one_process(capsys) -> None:
    # its double-apply check needs the newest term any node has seen, in one process
    assert StackOptions(nodes=5000, ha="failover").fleet_parts() == [(1, 5000)]
    args = build_parser().parse_args(["bench", "failover", "--sim-processes", "2"])
    assert args.func(args) == 2
    assert "--sim-processes must be 0 or 1" in capsys.readouterr().err


def test_fleet_stats_of_several_processes_read_as_one_fleet() -> None:
    a = {"nodes": 2, "registered": 2, "rpcs": {"ListWorkloads": 10, "ApplyWorkload": 1},
         "workloads_by_state": {"Running": 3}, "max_term_seen": 4, "timer_lag_max_s": 0.5,
         "over_capacity_node_ids": ["n1"], "per_node": {"n1": 2, "n2": 1},
         "applies_by_term": {"4": 1}}
    b = {"nodes": 3, "registered": 1, "rpcs": {"ListWorkloads": 7},
         "workloads_by_state": {"Running": 1, "Pending": 2}, "max_term_seen": 6,
         "timer_lag_max_s": 0.1, "over_capacity_node_ids": ["n3"], "per_node": {"n3": 3},
         "applies_by_term": {"4": 2, "6": 1}}
    merged = merge_fleet_stats([a, b])
    assert merged == {
        "nodes": 5, "registered": 3, "rpcs": {"ListWorkloads": 17, "ApplyWorkload": 1},
        "workloads_by_state": {"Running": 4, "Pending": 2}, "max_term_seen": 6,
        "timer_lag_max_s": 0.5, "over_capacity_node_ids": ["n1", "n3"],
        "per_node": {"n1": 2, "n2": 1, "n3": 3}, "applies_by_term": {"4": 3, "6": 1}}
    assert a["rpcs"] == {"ListWorkloads": 10, "ApplyWorkload": 1}  # inputs untouched
    assert merge_fleet_stats([a]) == a


def test_prometheus_text_sums_subtracts_and_knows_what_is_exported():
    snap = MetricsSnapshot.parse(METRICS)
    assert snap.total("persys_scheduler_etcd_txns_total") == 17
    assert snap.total("persys_scheduler_etcd_txns_total", result="conflict") == 2
    assert snap.by_label("persys_scheduler_etcd_txns_total", "kind") == {
        "placement": 12, "dispatch": 5}
    assert snap.exports("persys_scheduler_agent_rpcs_total")  # declared, no child yet
    assert not snap.exports("persys_scheduler_heartbeats_total")
    assert snap.total("odd_metric", label='a "quoted" value') == 1
    twice = MetricsSnapshot.merge([snap, snap])
    assert twice.minus(snap).total("persys_scheduler_etcd_txns_total") == 17
    assert snap.buckets("persys_scheduler_reconcile_cycle_seconds") == [
        (0.1, 1), (1.0, 3), (math.inf, 4)]


def test_bucket_quantile_interpolates_and_flags_the_inf_bucket():
    buckets = [(0.1, 1.0), (1.0, 3.0), (math.inf, 4.0)]
    value, caveat = bucket_quantile(buckets, 0.5)
    assert value == pytest.approx(0.1 + 0.9 * (2 - 1) / 2)
    assert caveat == ""
    value, caveat = bucket_quantile(buckets, 0.99)
    assert value == 1.0
    assert "lower bound" in caveat
    assert bucket_quantile([(1.0, 0.0), (math.inf, 0.0)], 0.99) == (None, "")


def test_stage_notes_read_histogram_deltas_and_say_what_is_missing():
    before = MetricsSnapshot.parse(STAGE_METRICS.format(relay_fast=0, relay_all=0, fsync=0,
                                                        fsync_all=0))
    after = MetricsSnapshot.parse(STAGE_METRICS.format(relay_fast=90, relay_all=100, fsync=50,
                                                       fsync_all=52))
    text = describe_stages([0.002, 0.004], before, after)
    assert text.startswith("SetNodeLabel as the client saw it (decide, commit, answer) "
                           "p50 2.0 p99 4.0 ms")
    # 90 of 100 within 10 ms: p50 interpolated in the first bucket, p99 in the second
    assert "decision to stream append (relay) p50 5.6 p99 19.0 ms" in text
    assert "hand-over to the watcher's stream: the target exports no" in text
    assert "unknown (no /metrics" in describe_stages([], None, after)
    storage = describe_storage(before, after, "/data")
    assert storage is not None
    assert storage.startswith("etcd WAL fsyncs during the run: 52, p99 ")
    assert "2 over 64 ms" in storage
    assert "under /data" in storage
    assert describe_storage(before, before, "/data") is None  # no fsync in the window


STAGE_METRICS = """\
# TYPE persys_scheduler_event_relay_delay_seconds histogram
persys_scheduler_event_relay_delay_seconds_bucket{{le="0.01"}} {relay_fast}
persys_scheduler_event_relay_delay_seconds_bucket{{le="0.02"}} {relay_all}
persys_scheduler_event_relay_delay_seconds_bucket{{le="+Inf"}} {relay_all}
# TYPE etcd_disk_wal_fsync_duration_seconds histogram
etcd_disk_wal_fsync_duration_seconds_bucket{{le="0.008"}} {fsync}
etcd_disk_wal_fsync_duration_seconds_bucket{{le="0.064"}} {fsync}
etcd_disk_wal_fsync_duration_seconds_bucket{{le="0.128"}} {fsync_all}
etcd_disk_wal_fsync_duration_seconds_bucket{{le="+Inf"}} {fsync_all}
"""


def test_percentile_is_nearest_rank():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([3.0, 1.0, 2.0], 0.99) == 3.0
    assert percentile(list(range(1, 101)), 0.99) == 99


def test_writes_are_grouped_by_prefix():
    assert key_group("/nodes/n1/status") == "/nodes/"
    assert key_group("/persys/scheduler/alive/n1") == "/persys/scheduler/alive/"
    assert key_group("/persys/scheduler/initialized") == "/persys/scheduler/initialized"
    assert key_group("/t/abc/workloads-status/w1", "/t/abc") == "/workloads-status/"


def test_writes_fall_into_the_same_categories_for_every_target():
    from collections import Counter

    from ops.benchlib.etcdwatch import describe_categories, write_category

    assert write_category(key_group("/nodes/n1/status")) == "node"
    assert write_category(key_group("/persys/scheduler/alive/n1")) == "node"
    assert write_category(key_group("/workloads-spec/w1")) == "workload spec"
    assert write_category(key_group("/workloads/w1")) == "workload spec"  # Go's legacy key
    assert write_category(key_group("/workloads-status/w1")) == "workload status"
    assert write_category(key_group("/retries/w1")) == "retry"
    assert write_category(key_group("/allocations/n1")) == "other"
    text = describe_categories(Counter({"/nodes/": 4, "/allocations/": 2}), 2)
    assert text == ("node 2, workload spec 0, workload status 0, retry 0, "
                    "other 1 (/allocations/ 1)")


@pytest.mark.parametrize("command", ["serve", "dev", "sim", "bench", "replay",
                                     "confirm-empty-state"])
def test_every_command_prints_its_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` must format (argparse %-formats help text; a stray % once broke ``bench``)."""
    with pytest.raises(SystemExit) as ended:
        build_parser().parse_args([command, "--help"])
    assert ended.value.code == 0
    assert f"persys-scheduler {command}" in capsys.readouterr().out


def test_failover_needs_two_replicas_and_defaults_to_them(capsys) -> None:
    # it used to start the whole stack with one replica and then fail with a traceback
    args = build_parser().parse_args(["bench", "failover", "--replicas", "1"])
    assert args.func(args) == 2
    assert ("persys-scheduler bench: failover needs --replicas 2 or more"
            in capsys.readouterr().err)
    args = build_parser().parse_args(["bench", "failover"])
    apply_defaults(args, SCENARIOS["failover"])
    assert args.replicas == 2
    args = build_parser().parse_args(["bench", "place"])
    apply_defaults(args, SCENARIOS["place"])
    assert args.replicas == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_run_interrupted_while_it_starts_leaves_no_directory(signum, tmp_path):
    # an interrupt is no failure: the run's directory (etcd's and Redis's data, the logs)
    # used to be kept, as after a failed start, and piled up under /tmp
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "bench", "place", *FAST],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "TMPDIR": str(tmp_path)})
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # blocks until the bench starts its stack
            if line.startswith("bench: starting"):
                break
        assert list(tmp_path.glob("persys-bench-*")), "the run's directory is not there"
        proc.send_signal(signum)
        rest = proc.communicate(timeout=60)[1]
        assert proc.returncode in (130, 143), rest
        assert "logs kept" not in rest
        assert list(tmp_path.glob("persys-bench-*")) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _nodes(address: str) -> dict[str, tuple[str, str]]:
    """node id -> (status, grpc endpoint), as the scheduler at ``address`` lists them."""
    with grpc.insecure_channel(address) as channel:
        reply = control_pb2_grpc.AgentControlStub(channel).ListNodes(
            control_pb2.ListNodesRequest(), timeout=30)
    return {n.node_id: (n.status, n.grpc_endpoint) for n in reply.nodes}


@pytest.mark.timeout(240)
def test_a_bench_against_a_dev_stack_brings_its_own_nodes(tmp_path):
    # the bench's fleet used dev's node ids (sim-node-00001 ...) and re-registered dev's
    # nodes at its own agents, which were gone once the bench ended
    dev = subprocess.Popen(
        [sys.executable, "-m", "ops.cli", "dev", "--nodes", "2", "--grpc-port", "0",
         "--data-dir", str(tmp_path / "dev")], cwd=ROOT, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "LOG_LEVEL": "warning"})
    try:
        assert dev.stdout is not None
        line = dev.stdout.readline()
        assert line.startswith("persys-scheduler dev: ready "), (line, dev.poll())
        addresses = dict(word.split("=", 1) for word in line.split()[3:])
        before = _nodes(addresses["grpc"])
        assert sorted(before) == ["sim-node-00001", "sim-node-00002"]
        result, _ = run_bench("place", "--scheduler", addresses["grpc"], "--metrics",
                              addresses["metrics"], "--nodes", "2", "--workloads", "4",
                              "--clients", "2", "--heartbeat-interval", "10")
        assert result["figures"]["nodes_over_capacity"] == 0
        after = _nodes(addresses["grpc"])
        assert {n: after[n] for n in before} == before  # dev's nodes: as they were
        theirs = sorted(set(after) - set(before))
        assert len(theirs) == 2, after
        assert all(re.fullmatch(r"bench-[0-9a-f]{6}-node-0000[12]", n) for n in theirs), theirs
        dev.send_signal(signal.SIGINT)
        assert dev.wait(timeout=60) == 0
    finally:
        if dev.poll() is None:
            dev.kill()
            dev.wait()


@pytest.fixture
def go_standin():
    """The stand-in of tests/fixtures/go_standin.py (older RPC set, Go metric names only),
    started as its own process; yields (grpc address, metrics address, pid)."""
    from ops.devstack.process import free_port

    def start(*extra: str):
        grpc_port, metrics_port = free_port(), free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fixtures.go_standin", "--grpc-port", str(grpc_port),
             "--metrics-port", str(metrics_port), *extra],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        started.append(proc)
        def serving() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                            timeout=1):
                    return True
            except OSError:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                return False

        wait_for_sync(serving, timeout=20, interval=0.1, message="the stand-in did not start")
        return f"127.0.0.1:{grpc_port}", f"127.0.0.1:{metrics_port}", proc.pid

    started: list[subprocess.Popen] = []
    try:
        yield start
    finally:
        for proc in started:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.timeout(120)
def test_events_against_a_scheduler_without_the_event_rpcs_exits_non_zero_naming_them(
        go_standin):
    grpc_addr, metrics_addr, _ = go_standin()
    proc = subprocess.run(
        [sys.executable, "-m", "ops.cli", "bench", "events", "--nodes", "3", "--watchers", "2",
         "--rate", "10", "--scheduler", grpc_addr, "--metrics", metrics_addr, "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=100, check=False)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "events needs SetNodeLabel, WatchEvents, which the target does not implement" \
        in proc.stderr
    assert "events_lost" not in proc.stdout  # no figure that only looks measured
    proc = subprocess.run(
        [sys.executable, "-m", "ops.cli", "bench", "pending", "--nodes", "3", "--workloads", "2",
         "--scheduler", grpc_addr, "--metrics", metrics_addr, "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=100, check=False)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "pending needs ListEvents, WatchEvents, which the target does not implement" \
        in proc.stderr


@pytest.mark.timeout(150)
def test_reconcile_against_the_go_names_waits_for_a_slow_first_cycle(go_standin):
    # the first cycle ends 25 s after the start, later than the two intervals + 10 s the
    # bench used to wait before it gave every cycle figure up as null
    grpc_addr, metrics_addr, pid = go_standin("--first-cycle-delay", "25")
    result, _ = run_bench("reconcile", "--nodes", "3", "--workloads", "6", "--cycles", "2",
                          "--heartbeat-interval", "1", "--reconcile-interval", "1",
                          "--scheduler", grpc_addr, "--metrics", metrics_addr,
                          "--scheduler-pid", str(pid), limit_s=120)
    figures, notes = result["figures"], result["notes"]
    assert figures["cycle_time_p50_ms"] is not None, notes
    assert figures["cycle_time_p99_ms"] >= figures["cycle_time_p50_ms"]
    # the stand-in lists each of the 3 agents once per cycle
    assert figures["agent_rpcs_per_cycle"] == pytest.approx(3, abs=0.5), notes
    assert figures["etcd_writes_per_cycle"] == 0
    assert "persys_scheduler_reconciliation_cycles_total" in notes["metrics"]
    assert "the Go scheduler's names" in notes["metrics"]
    assert "censored" not in notes
    # its pid was given: memory is measured for another scheduler too
    assert figures["scheduler_rss_mib"] > 0
    assert figures["scheduler_peak_rss_mib"] >= figures["scheduler_rss_mib"] - 0.5
    # no --etcd: the figure counted from etcd says so
    assert figures["heartbeat_etcd_writes_per_s"] is None
    assert "--etcd" in notes["heartbeat_etcd_writes_per_s"]


@pytest.mark.timeout(120)
def test_a_churn_recovery_that_never_ends_is_reported_censored(go_standin):
    grpc_addr, metrics_addr, _ = go_standin()  # it never re-applies a vanished workload
    result, _ = run_bench("churn", "--nodes", "3", "--workloads", "6",
                          "--heartbeat-interval", "1", "--reconcile-interval", "1",
                          "--reapply-guard", "1", "--recovery-timeout", "5",
                          "--scheduler", grpc_addr, "--metrics", metrics_addr)
    figures, notes = result["figures"], result["notes"]
    assert figures["killed"] >= 1
    assert figures["recovery_s"] >= 5.0
    assert notes["recovery_s"].startswith("censored: more than 5")
    assert notes["censored"] == "recovery_s"
    # no --scheduler-pid: the memory figure is null and says why
    assert figures["scheduler_peak_rss_mib"] is None
    assert "--scheduler-pid" in notes["scheduler_peak_rss_mib"]


def test_the_stale_write_tally_counts_only_the_resumed_leaders_own_writes_in_its_window():
    """The negative control of stale_leader_writes: a write inside the window is counted; what
    any standby writes for itself, and anything outside the window, is not."""
    from eventsource.etcd import KeyValue
    from eventsource.watch import WatchEvent
    from ops.benchlib.failover import _Stale

    def put(key: str, rev: int, value: bytes = b"{}", lease: int = 0) -> WatchEvent:
        return WatchEvent(kv=KeyValue(key=key, value=value, create_revision=rev,
                                      mod_revision=rev, version=1, lease=lease), deleted=False)

    tally = _Stale("/r")
    tally.seen(put("/r/workloads-status/w1", 5))  # before any window
    tally.begin(10)
    tally.seen(put("/r/workloads-status/w1", 10))  # at the window's start: not after it
    tally.seen(put("/r/workloads-status/w1", 11))  # the resumed leader's: counted
    tally.seen(WatchEvent(kv=KeyValue(key="/r/retries/w2", value=b"", create_revision=0,
                                      mod_revision=12, version=0), deleted=True))
    tally.seen(put("/r/persys/scheduler/leader/abc", 13, lease=7))  # a new campaign key
    tally.seen(WatchEvent(kv=KeyValue(key="/r/skydns/local/persys/x/bench-0", value=b"",
                                      create_revision=0, mod_revision=13, version=0),
                          deleted=True))  # its own DNS record, withdrawn
    tally.seen(put("/r/persys/scheduler/outbox/e1", 14,
                   b'{"type":"SchedulerModeChanged","details":{"from":"normal",'
                   b'"to":"degraded"}}'))
    tally.seen(put("/r/persys/scheduler/outbox/e2", 15, b'{"type":"WorkloadScheduled"}'))
    tally.end(15)
    tally.seen(put("/r/workloads-status/w1", 16))  # after the window: the others run again
    assert sum(tally.counted.values()) == 3
    assert tally.counted == {"/workloads-status/": 1, "/retries/": 1,
                             "/persys/scheduler/outbox/": 1}
    assert tally.event_types == {"WorkloadScheduled": 1}
    assert tally.leased == {"/persys/scheduler/leader/": 1, "/skydns/ (deletes)": 1}
    assert tally.per_replica == {"SchedulerModeChanged normal -> degraded": 1}


def test_a_py_spy_profile_is_summed_by_own_and_inclusive_samples():
    from ops.benchlib.profile import summarize

    total, own, inclusive = summarize("main;loop;decide 6\nmain;loop;commit 3\nmain;gc 1\n"
                                      "garbage line\n", top=2)
    assert total == 10
    assert own == [("decide", 6), ("commit", 3)]
    assert inclusive == [("main", 10), ("loop", 9)]


@pytest.mark.parametrize(("stack", "stage"), [
    ("run (asyncio/runners.py:1);place (/src/handlers/placement/decision.py:9)", "decision"),
    # the innermost scheduler frame decides: the dispatcher calling the etcd client is commit
    ("_apply (/src/handlers/workloads/dispatch.py:3);txn (/src/eventsource/etcd.py:4)",
     "commit and its JSON (etcd client)"),
    ("x (/src/handlers/workloads/dispatch.py:3);call (grpc/aio/_call.py:4)",
     "dispatch to agents"),
    ("_fold (/src/projections/prefix.py:2)", "watch decode and projections"),
    ("_view (/src/projections/events.py:2)", "event fan-out (stream reads, watchers)"),
    ("_handle_rpc (grpc/_cython/_cygrpc/aio/server.pyx.pxi:7)",
     "grpc's asyncio machinery (no scheduler frame)"),
    ("select (selectors.py:1)", "event loop and other libraries (no scheduler frame)"),
    ("main (ops/cli.py:1);run (handlers/app/eventloop.py:44)",
     "event loop, uvloop and grpc's native code (no Python frame below the loop)"),
])
def test_a_profile_sample_is_charged_to_its_innermost_scheduler_stage(stack, stage):
    from ops.benchlib.profile import stage_of, stage_shares

    assert stage_of(stack.split(";")) == stage
    total, shares = stage_shares(f"{stack} 3\nmain;select (selectors.py:1) 1\n")
    assert total == 4
    assert dict(shares)[stage] >= 3


@pytest.mark.timeout(120)
def test_place_with_a_profile_names_the_scheduler_functions(tmp_path):
    from ops.benchlib.profile import py_spy

    if py_spy() is None:
        pytest.skip("py-spy is not installed (pip install py-spy)")
    result, _ = run_bench("place", *FAST, "--clients", "4", "--workloads", "100",
                          "--profile", str(tmp_path))
    note = result["notes"]["profile"]
    assert "scheduler-0: " in note, note
    assert "most own samples" in note, note
    assert list(tmp_path.glob("scheduler-0-*.txt")), note


def test_the_benchmark_contract_is_in_the_repository(capsys) -> None:
    # bench --help and operations.md pointed to BENCH.md "in the design notes", which users
    # do not have: docs/benchmark.md names every scenario, figure and option
    doc = (ROOT / "docs" / "benchmark.md").read_text()
    for name, scenario in SCENARIOS.items():
        assert f"### `{name}`" in doc, name
        for figure in scenario.figures:
            assert f"`{figure}`" in doc, (name, figure)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    help_text = capsys.readouterr().out
    for option in re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", help_text):
        if option != "--help":
            assert f"`{option}" in doc, option
    for text in (help_text, (ROOT / "docs" / "operations.md").read_text()):
        assert "BENCH.md" not in text
        assert "docs/benchmark.md" in text
