"""The server's certificate files: reloaded when they change, a broken set tried and logged
once, the last good configuration kept meanwhile (files from a real openssl CA)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest

from handlers.cluster.tls import ServerCertificates
from tests.fixtures.certs import TestCA


@pytest.fixture
def files(tmp_path):
    ca = TestCA(tmp_path / "ca")
    first = ca.issue("persys-scheduler", names=("127.0.0.1",))
    second = ca.issue("persys-scheduler", names=("127.0.0.1",))
    served = tmp_path / "served"
    served.mkdir()
    paths = {"ca": served / "ca.pem", "cert": served / "cert.pem", "key": served / "key.pem"}
    shutil.copy(ca.cert_path, paths["ca"])
    shutil.copy(first.cert_path, paths["cert"])
    shutil.copy(first.key_path, paths["key"])
    return ca, first, second, paths


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "persys.tls" and r.levelno == logging.WARNING]


def test_unchanged_files_are_not_reloaded(files):
    _, _, _, paths = files
    certs = ServerCertificates(str(paths["ca"]), str(paths["cert"]), str(paths["key"]))
    assert certs.fetch() is None
    assert certs.fetch() is None


def test_a_broken_set_is_tried_once_and_a_good_one_is_loaded(files, caplog):
    _, _, second, paths = files
    certs = ServerCertificates(str(paths["ca"]), str(paths["cert"]), str(paths["key"]))
    caplog.set_level(logging.INFO, logger="persys.tls")
    # a rotation half done: the new certificate with the old key
    shutil.copy(second.cert_path, paths["cert"])
    assert certs.fetch() is None
    assert certs.fetch() is None
    assert len(warnings(caplog)) == 1
    # the key arrives: the pair is loaded
    shutil.copy(second.key_path, paths["key"])
    assert certs.fetch() is not None
    assert certs.fetch() is None


def test_a_copy_that_keeps_the_modification_time_is_still_seen(files):
    _, _, second, paths = files
    certs = ServerCertificates(str(paths["ca"]), str(paths["cert"]), str(paths["key"]))
    before = {name: path.stat().st_mtime_ns for name, path in paths.items()}
    for name, source in (("cert", second.cert_path), ("key", second.key_path)):
        replacement = paths[name].with_suffix(".new")
        shutil.copy(source, replacement)
        os.utime(replacement, ns=(before[name], before[name]))
        os.replace(replacement, paths[name])  # a new inode, the old mtime
    assert certs.fetch() is not None


def test_garbage_and_a_missing_file_keep_the_last_good(files, caplog):
    _, _, _, paths = files
    certs = ServerCertificates(str(paths["ca"]), str(paths["cert"]), str(paths["key"]))
    caplog.set_level(logging.INFO, logger="persys.tls")
    paths["ca"].write_bytes(b"\xff\xfe not a certificate")
    assert certs.fetch() is None
    paths["ca"].unlink()
    assert certs.fetch() is None
    assert certs.fetch() is None
    assert len(warnings(caplog)) == 2
    with pytest.raises(FileNotFoundError):  # nothing to fall back to at start
        ServerCertificates(str(paths["ca"]), str(paths["cert"]), str(paths["key"]))


def test_serve_without_its_certificate_files_names_the_variable(tmp_path) -> None:
    """A first start without -insecure and without the files: one line naming the variable,
    exit 2, instead of a FileNotFoundError traceback."""
    env = {"PATH": os.environ.get("PATH", ""), "PERSYS_TLS_CA": str(tmp_path / "ca.pem"),
           "ETCD_ENDPOINTS": "127.0.0.1:1"}
    done = subprocess.run([sys.executable, "-m", "ops.cli", "serve"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert "PERSYS_TLS_CA" in done.stderr
    assert "Traceback" not in done.stderr
