"""The gRPC server's mTLS certificates, reloaded from disk when they change.

As in the Go version: the CA, certificate and key files are checked before each handshake and
picked up when their modification times change, and a reload that fails keeps the last good
configuration. Two things this adds to handing gRPC fresh bytes on every handshake:

* gRPC builds a new TLS context whenever it is given a configuration. Offering one only when a
  file's modification time changed spares that work on each handshake; after a restart, 5,000
  agents reconnect at once.
* Files that exist but do not parse or do not match (a certificate half-written by a rotation,
  a key of another pair) are refused here, once, with a log line naming the problem. gRPC
  would also keep its previous context, but would be offered the broken files again on every
  handshake.
"""

from __future__ import annotations

import logging
import os
import ssl

import grpc

log = logging.getLogger("persys.tls")


class ServerCertificates:
    """Files -> ``grpc.ServerCertificateConfiguration``, validated, cached by file stamp."""

    def __init__(self, ca: str, cert: str, key: str) -> None:
        self._paths = (ca, cert, key)
        #: the stamp of the files last tried, loaded or not: a broken set is tried (and
        #: logged) once, not on every handshake
        self._tried: tuple[tuple[int, ...], ...] | None = None
        self._last_error = ""
        self._config = self._load(self._stamps())  # must succeed: nothing to fall back to

    def _stamps(self) -> tuple[tuple[int, ...], ...]:
        """Modification time, change time, inode and size of each file: a rotation that keeps
        the old modification time (``cp -p``, ``tar``) still changes the inode or ctime."""
        stamps = []
        for path in self._paths:
            st = os.stat(path)
            stamps.append((st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_size))
        return tuple(stamps)

    def _load(self, stamp: tuple[tuple[int, ...], ...]) -> grpc.ServerCertificateConfiguration:
        self._tried = stamp
        ca, cert, key = (_read(p) for p in self._paths)
        _validate(*self._paths, ca)
        if (ca, cert, key) != tuple(_read(p) for p in self._paths):
            raise ValueError("the files changed while they were read")
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._config, self.fetch,
                                                   require_client_authentication=True)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before each handshake: a new configuration, or None to keep the
        current one."""
        try:
            stamp = self._stamps()
            if stamp == self._tried:
                return None
            self._config = self._load(stamp)
        except (OSError, ValueError, ssl.SSLError) as exc:
            if str(exc) != self._last_error:  # once per problem, not once per handshake
                log.warning("tls files not reloaded, the last good ones stay in use: %s", exc)
                self._last_error = str(exc)
            return None
        self._last_error = ""
        log.info("tls files reloaded ca=%s cert=%s key=%s", *self._paths)
        return self._config


def unusable(ca: str, cert: str, key: str) -> str | None:
    """Why the three files cannot serve (missing, unparsable, a key of another pair), or None."""
    try:
        _validate(ca, cert, key, _read(ca))
    except (OSError, ValueError, ssl.SSLError) as exc:
        return str(exc) or type(exc).__name__
    return None


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _validate(ca_path: str, cert_path: str, key_path: str, ca: bytes) -> None:
    """Raise unless the key matches the certificate and the CA file holds a certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_path, key_path)
    try:
        context.load_verify_locations(cadata=ca.decode("ascii"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{ca_path}: not a PEM file") from exc
