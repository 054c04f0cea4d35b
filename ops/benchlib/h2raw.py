"""Just enough client-side HTTP/2 framing to be a hostile gRPC caller (``bench attack``).

Why not a grpc client: grpc reads its socket on its own threads whatever the application does,
so a grpc caller that "does not read its answer" still drains the TCP window into its own
buffers; and it never sends a stream's RST_STREAM right after its HEADERS on purpose. Why not
the ``h2`` library: it is not a dependency of the project, and these attacks need only a few
frames, written by hand (RFC 9113 framing, RFC 7541 literal header fields without indexing and
without Huffman coding, which every HPACK decoder accepts).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
#: SETTINGS identifiers
ENABLE_PUSH, INITIAL_WINDOW_SIZE = 0x2, 0x4
#: RST_STREAM / GOAWAY error codes
NO_ERROR, CANCEL, REFUSED_STREAM, ENHANCE_YOUR_CALM = 0x0, 0x8, 0x7, 0xB
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
HEADER_LEN = 9


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame: 24-bit length, type, flags, 31-bit stream id, payload."""
    return (struct.pack(">I", len(payload))[1:] + bytes((kind, flags))
            + struct.pack(">I", stream_id & MAX_WINDOW) + payload)


def _hpack_int(value: int, prefix_bits: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((value,))
    out = bytearray((limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, new name, no Huffman coding."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def grpc_request_headers(authority: str, method: str) -> bytes:
    """The HPACK block of a gRPC call of ``method`` ("/package.Service/Method")."""
    fields = ((b":method", b"POST"), (b":scheme", b"http"), (b":path", method.encode()),
              (b":authority", authority.encode()), (b"content-type", b"application/grpc"),
              (b"te", b"trailers"))
    return b"".join(_literal(n, v) for n, v in fields)


def grpc_message(body: bytes) -> bytes:
    """A length-prefixed gRPC message (not compressed)."""
    return b"\x00" + struct.pack(">I", len(body)) + body


def client_start(*, window: int = DEFAULT_WINDOW, ack_settings: bool = False) -> bytes:
    """The connection preface and the client's SETTINGS (push off, ``window`` per stream); with
    a window above the default, the connection window is opened as far too. ``ack_settings``
    adds a SETTINGS ACK for the server's SETTINGS, which a server sends on accepting, so that a
    caller that never reads still acknowledges them."""
    settings = struct.pack(">HI", ENABLE_PUSH, 0) + struct.pack(">HI", INITIAL_WINDOW_SIZE, window)
    out = PREFACE + frame(SETTINGS, 0, 0, settings)
    if window > DEFAULT_WINDOW:
        out += frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", window - DEFAULT_WINDOW))
    if ack_settings:
        out += frame(SETTINGS, ACK, 0)
    return out


def unary_call(stream_id: int, header_block: bytes, body: bytes = b"") -> bytes:
    """HEADERS then the request message with END_STREAM: a whole unary request."""
    return (frame(HEADERS, END_HEADERS, stream_id, header_block)
            + frame(DATA, END_STREAM, stream_id, grpc_message(body)))


def rst_stream(stream_id: int, code: int = CANCEL) -> bytes:
    return frame(RST_STREAM, 0, stream_id, struct.pack(">I", code))


@dataclass
class Frame:
    kind: int
    flags: int
    stream_id: int
    payload: bytes


class FrameReader:
    """Splits received bytes into frames (``feed`` returns the frames completed so far)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self._buffer += data
        frames: list[Frame] = []
        while len(self._buffer) >= HEADER_LEN:
            length = int.from_bytes(self._buffer[0:3], "big")
            if len(self._buffer) < HEADER_LEN + length:
                break
            kind, flags = self._buffer[3], self._buffer[4]
            stream_id = int.from_bytes(self._buffer[5:9], "big") & MAX_WINDOW
            payload = bytes(self._buffer[HEADER_LEN:HEADER_LEN + length])
            del self._buffer[:HEADER_LEN + length]
            frames.append(Frame(kind, flags, stream_id, payload))
        return frames


def goaway_fields(payload: bytes) -> tuple[int, int]:
    """(last stream id, error code) of a GOAWAY payload."""
    last, code = struct.unpack(">II", payload[:8])
    return last & MAX_WINDOW, code
