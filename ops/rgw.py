"""A throw-away single-host Ceph cluster with a RADOS Gateway, on loopback, for tests.

Why this exists: the bucket API (handlers/storage/buckets/) is only trustworthy when it is tested
against a real radosgw (S3 + Admin Ops), and Debian packages one (``ceph-mon ceph-osd radosgw
ceph-common``). This module starts one mon, one memstore OSD and one radosgw in a work
directory, creates an admin user with the caps the bucket API needs, and warms the gateway up,
so the first test sees steady-state latency. It follows the usual single-host recipe (one mon,
one memstore OSD, one radosgw).

Invariants:

* Everything listens on 127.0.0.1 and lives under the work directory: ``ceph.conf``, keyrings,
  mon/OSD data, run files and logs. ``/etc/ceph`` and ``/var/lib/ceph`` are never touched; every
  ``ceph``/``radosgw-admin`` call gets ``-c <work dir>/ceph.conf``.
* Authentication is ``none`` (a throw-away cluster); radosgw then needs
  ``ms mon client mode = crc secure`` (it forces "secure" otherwise, which needs cephx, and
  loops on ``get_initial_auth_request returned -13`` forever).
* Fast paxos (``paxos propose interval = 0.05``): radosgw creates its pools one by one, and each
  osdmap change would otherwise wait ~1 s.
* The beast frontend gets ``tcp_nodelay=1``: without it, a response written in two parts waits
  for the client's delayed ACK on a kept-alive connection, and every boto3 call takes ~40 ms
  more (measured here: 45 ms -> 3 ms for GetBucketVersioning).
* Every daemon runs in the foreground (``-f``) in its own session, so the ``Popen`` object is
  the daemon; ``stop()`` SIGKILLs exactly the processes this object started (by PID, newest
  first) and reaps them. The data is in RAM (memstore), so nothing is lost that matters.
* A start that fails stops what it started and raises ``ServerStartError`` with the log tails.
* Never run ``ceph osd df`` or other mgr-served commands here: there is no mgr, they hang.

This module imports nothing from the rest of the project except ``ops.devstack`` helpers.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Self

from ops.devstack.process import ServerStartError, _tail, free_port, pid_alive

__all__ = ["APT_PACKAGES", "RgwCluster", "missing_binaries"]

#: Debian packages that provide every binary used here.
APT_PACKAGES = ("ceph-mon", "ceph-osd", "radosgw", "ceph-common")
_BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "ceph-authtool",
             "monmaptool")
#: OSDs bind ports from this range (ms_bind_port_min/max); keep the mon and RGW out of it.
_OSD_PORTS = range(6800, 7301)
#: The admin user's caps: what the bucket API's Admin Ops calls need.
ADMIN_CAPS = "users=*;buckets=*;usage=*;metadata=*"


def missing_binaries() -> list[str]:
    """The Ceph binaries not found on PATH (empty when the packages are installed)."""
    return [b for b in _BINARIES if shutil.which(b) is None]


def _port_outside_osd_range(taken: set[int]) -> int:
    while True:
        port = free_port()
        if port not in taken and port not in _OSD_PORTS:
            return port


class RgwCluster:
    """mon.a + osd.0 (memstore) + client.rgw.a on 127.0.0.1, plus an Admin Ops capable user.

    Usage::

        with RgwCluster().start(tmp / "ceph") as rgw:
            boto3.client("s3", endpoint_url=rgw.endpoint, aws_access_key_id=rgw.access_key, ...)
    """

    def __init__(self, *, memstore_bytes: int = 512 * 1024 * 1024,
                 start_timeout: float = 90.0) -> None:
        self.memstore_bytes = memstore_bytes
        self.start_timeout = start_timeout
        self.work_dir: Path | None = None
        self.rgw_port = 0
        self.mon_ports: tuple[int, int] = (0, 0)
        self.access_key = ""
        self.secret_key = ""
        #: Seconds from ``start()`` to each milestone (mon, osd, rgw, admin, ready).
        self.timings: dict[str, float] = {}
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    # -- addresses -----------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.rgw_port}"

    @property
    def conf_path(self) -> Path:
        assert self.work_dir is not None, "not started"
        return self.work_dir / "ceph.conf"

    @property
    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self._procs}

    def log_tail(self, limit: int = 3000) -> str:
        if self.work_dir is None:
            return "(not started)"
        logs = sorted((self.work_dir / "log").glob("*"))
        return _tail(*logs, limit=limit)

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, work_dir: Path) -> Self:
        """Bring the cluster up in ``work_dir`` (created; must be empty) and return ``self``.

        Raises:
            ServerStartError: a binary is missing (the message has the apt-get line) or a
                daemon did not come up before ``start_timeout`` (the message has log tails).
        """
        missing = missing_binaries()
        if missing:
            raise ServerStartError(
                f"Ceph RGW binaries missing: {', '.join(missing)}; install them with "
                f"'apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y "
                f"--no-install-recommends {' '.join(APT_PACKAGES)}'")
        work_dir.mkdir(parents=True, exist_ok=True)
        if any(work_dir.iterdir()):
            raise ServerStartError(f"{work_dir} is not empty")
        self.work_dir = work_dir.resolve()
        for sub in ("run", "log", "mon/ceph-a", "osd/ceph-0", "rgw/ceph-rgw.a", "crash"):
            (self.work_dir / sub).mkdir(parents=True, exist_ok=True)
        self.rgw_port = _port_outside_osd_range(set())
        v2 = _port_outside_osd_range({self.rgw_port})
        v1 = _port_outside_osd_range({self.rgw_port, v2})
        self.mon_ports = (v2, v1)
        started = time.monotonic()
        deadline = started + self.start_timeout
        try:
            self._write_conf(str(uuid.uuid4()))
            self._start_mon()
            self._wait(self._mon_answers, deadline, "mon.a answering")
            self.timings["mon"] = time.monotonic() - started
            self._start_osd()
            self._wait(self._osd_up, deadline, "osd.0 up")
            self.timings["osd"] = time.monotonic() - started
            self._spawn("rgw.a", ["radosgw", "-c", str(self.conf_path), "-f",
                                  "-n", "client.rgw.a"])
            self._wait(self._rgw_answers, deadline, f"radosgw on {self.endpoint}")
            self.timings["rgw"] = time.monotonic() - started
            self._create_admin()
            self.timings["admin"] = time.monotonic() - started
            self._warm_up()
            self.timings["ready"] = time.monotonic() - started
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGKILL and reap every daemon this object started (newest first); idempotent."""
        while self._procs:
            _, proc = self._procs.pop()
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()

    def running(self) -> bool:
        return bool(self._procs) and all(
            proc.poll() is None and pid_alive(proc.pid) for _, proc in self._procs)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- steps ---------------------------------------------------------------------------------

    def _write_conf(self, fsid: str) -> None:
        w = self.work_dir
        v2, v1 = self.mon_ports
        conf = f"""[global]
fsid = {fsid}
mon host = [v2:127.0.0.1:{v2},v1:127.0.0.1:{v1}]
mon initial members = a
public addr = 127.0.0.1
cluster addr = 127.0.0.1
public network = 127.0.0.0/8
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
auth allow insecure global id reclaim = true
run dir = {w}/run
crash dir = {w}/crash
log file = {w}/log/$name.log
pid file = {w}/run/$name.pid
admin socket = {w}/run/$name.asok
keyring = {w}/keyring
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon max pg per osd = 1000
mon warn on pool no redundancy = false
mon data avail warn = 2
mon data avail crit = 1
mon warn on insecure global id reclaim = false
mon warn on insecure global id reclaim allowed = false
osd max object name len = 460
osd max object namespace len = 64
err to stderr = false
log to stderr = false

[mon]
paxos propose interval = 0.05
paxos min wait = 0.01
mon data = {w}/mon/$cluster-$id
mon cluster log file = {w}/log/cluster.log

[osd]
osd data = {w}/osd/$cluster-$id
osd objectstore = memstore
memstore device bytes = {self.memstore_bytes}

[client.rgw.a]
ms mon client mode = crc secure
rgw data = {w}/rgw/$cluster-$id
rgw frontends = beast endpoint=127.0.0.1:{self.rgw_port} tcp_nodelay=1
rgw enable usage log = true
rgw enable ops log = false
rgw thread pool size = 32
rgw init timeout = 120
"""
        self.conf_path.write_text(conf)

    def _start_mon(self) -> None:
        w = self.work_dir
        assert w is not None
        keyring = str(w / "keyring")
        self._run(["ceph-authtool", "--create-keyring", keyring, "--gen-key", "-n", "mon.",
                   "--cap", "mon", "allow *"])
        self._run(["ceph-authtool", keyring, "--gen-key", "-n", "client.admin",
                   "--cap", "mon", "allow *", "--cap", "osd", "allow *",
                   "--cap", "mgr", "allow *"])
        fsid = self._conf_value("fsid")
        v2, v1 = self.mon_ports
        self._run(["monmaptool", "--create", "--fsid", fsid, "--addv", "a",
                   f"[v2:127.0.0.1:{v2},v1:127.0.0.1:{v1}]", str(w / "monmap")])
        self._run(["ceph-mon", "-c", str(self.conf_path), "--mkfs", "-i", "a",
                   "--monmap", str(w / "monmap"), "--keyring", keyring])
        self._spawn("mon.a", ["ceph-mon", "-c", str(self.conf_path), "-f", "-i", "a"])

    def _start_osd(self) -> None:
        osd_uuid = str(uuid.uuid4())
        osd_id = self._ceph("osd", "new", osd_uuid).strip()
        if osd_id != "0":
            raise ServerStartError(f"unexpected OSD id {osd_id!r}")
        self._run(["ceph-osd", "-c", str(self.conf_path), "-i", "0", "--mkfs",
                   "--osd-uuid", osd_uuid], timeout=60)
        self._spawn("osd.0", ["ceph-osd", "-c", str(self.conf_path), "-f", "-i", "0"])

    def _create_admin(self) -> None:
        out = self._run(["radosgw-admin", "-c", str(self.conf_path), "-n", "client.admin",
                         "user", "create", "--uid=admin", "--display-name=RGW admin",
                         f"--caps={ADMIN_CAPS}"], timeout=60)
        keys = json.loads(out)["keys"][0]
        self.access_key = keys["access_key"]
        self.secret_key = keys["secret_key"]

    def _warm_up(self) -> None:
        """Create, fill and delete a bucket: RGW creates its index/data pools on first use."""
        bucket = f"/warmup-{uuid.uuid4().hex[:8]}"
        for method, path, body in (("PUT", bucket, b""), ("PUT", bucket + "/o", b"x"),
                                   ("DELETE", bucket + "/o", b""), ("DELETE", bucket, b"")):
            status = self._signed(method, path, body)
            if status not in (200, 204):
                raise ServerStartError(f"warm-up {method} {path} answered {status}")

    # -- probes --------------------------------------------------------------------------------

    def _mon_answers(self) -> bool:
        try:
            self._ceph("mon", "stat", timeout=5)
        except ServerStartError:
            return False
        return True

    def _osd_up(self) -> bool:
        try:
            dump = json.loads(self._ceph("osd", "dump", "--format=json", timeout=5))
        except (ServerStartError, ValueError):
            return False
        return any(o.get("osd") == 0 and o.get("up") == 1 for o in dump.get("osds", []))

    def _rgw_answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint + "/", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False
        except http.client.HTTPException as exc:
            # something else took the port between our choice and radosgw's bind (an HTTP/2
            # server answers with a frame): say so instead of a protocol error
            raise ServerStartError(f"port {self.rgw_port} answers, but not as radosgw: "
                                   f"{type(exc).__name__}\n{self.log_tail()}") from exc

    def _wait(self, probe: Callable[[], bool], deadline: float, what: str) -> None:
        delay = 0.05
        while True:
            for name, proc in self._procs:
                if proc.poll() is not None:
                    raise ServerStartError(
                        f"{name} exited with {proc.returncode} while waiting for {what}\n"
                        f"{self.log_tail()}")
            if probe():
                return
            if time.monotonic() > deadline:
                raise ServerStartError(f"timed out waiting for {what}\n{self.log_tail()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    # -- helpers -------------------------------------------------------------------------------

    def _conf_value(self, key: str) -> str:
        for line in self.conf_path.read_text().splitlines():
            name, _, value = line.partition("=")
            if name.strip() == key:
                return value.strip()
        raise KeyError(key)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["CEPH_CONF"] = str(self.conf_path)
        return env

    def _run(self, argv: list[str], *, timeout: float = 30.0) -> str:
        assert self.work_dir is not None
        try:
            out = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                                 timeout=timeout, env=self._env(), check=False,
                                 cwd=self.work_dir)
        except subprocess.TimeoutExpired as exc:
            raise ServerStartError(f"{argv[0]} timed out after {timeout}s") from exc
        if out.returncode != 0:
            raise ServerStartError(
                f"{' '.join(argv[:3])} failed with {out.returncode}: "
                f"{out.stderr.decode(errors='replace')[-2000:]}")
        return out.stdout.decode(errors="replace")

    def _ceph(self, *words: str, timeout: float = 20.0) -> str:
        return self._run(["ceph", "-c", str(self.conf_path), "--connect-timeout",
                          str(int(max(1, timeout - 1))), *words], timeout=timeout)

    def _spawn(self, name: str, argv: list[str]) -> None:
        assert self.work_dir is not None
        log_path = self.work_dir / "log" / f"{name}.out"
        with log_path.open("ab") as log, open(os.devnull, "rb") as devnull:
            proc = subprocess.Popen(argv, stdin=devnull, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=self.work_dir, env=self._env(),
                                    start_new_session=True, close_fds=True)
        self._procs.append((name, proc))

    def _signed(self, method: str, path: str, body: bytes) -> int:
        """One SigV4-signed S3 request with the admin keys (botocore's S3 signer)."""
        from botocore.auth import S3SigV4Auth  # type: ignore[import-untyped]
        from botocore.awsrequest import AWSRequest  # type: ignore[import-untyped]
        from botocore.credentials import Credentials  # type: ignore[import-untyped]

        request = AWSRequest(method=method, url=self.endpoint + path, data=body)
        S3SigV4Auth(Credentials(self.access_key, self.secret_key), "s3", "default").add_auth(
            request)
        prepared = urllib.request.Request(self.endpoint + path, data=body or None,
                                          method=method, headers=dict(request.headers.items()))
        try:
            with urllib.request.urlopen(prepared, timeout=30) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
