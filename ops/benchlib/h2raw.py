"""Just enough client-side HTTP/2 framing to be a hostile gRPC caller (``bench attack``).

Why not a grpc client: grpc reads its socket on its own threads whatever the application does,
so a grpc caller that "does not read its answer" still drains the TCP window into its own
buffers; and it never sends a stream's RST_STREAM right after its HEADERS on purpose. Why not
the ``h2`` library: it is not a dependency of the project (only of its tests), and these
attacks need only a few frames, written by hand (RFC 9113 framing, RFC 7541 literal header
fields without indexing and without Huffman coding, which every HPACK decoder accepts).

``HeaderDecoder`` reads the server's header blocks (to see a ``grpc-status``): the static and
dynamic tables and every field representation, but no Huffman decoding; a Huffman-coded string
decodes as ``None``. gRPC core does not Huffman-code the values it sends (only ``-bin`` ones).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
CONTINUATION = 0x9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
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


def ack_of(f: Frame) -> bytes:
    """What a client owes the server for ``f``: the ACK of a SETTINGS or a PING (else b"")."""
    if f.flags & ACK:
        return b""
    if f.kind == SETTINGS:
        return frame(SETTINGS, ACK, 0)
    if f.kind == PING:
        return frame(PING, ACK, 0, f.payload)
    return b""


def rst_code(f: Frame) -> int:
    """The error code of a RST_STREAM frame."""
    return int.from_bytes(f.payload[:4], "big")


def goaway_fields(payload: bytes) -> tuple[int, int]:
    """(last stream id, error code) of a GOAWAY payload."""
    last, code = struct.unpack(">II", payload[:8])
    return last & MAX_WINDOW, code


def header_block_fragment(f: Frame) -> bytes:
    """The header block fragment of a HEADERS frame (padding and priority taken off) or of a
    CONTINUATION frame."""
    payload = f.payload
    if f.kind != HEADERS:
        return payload
    pad = 0
    if f.flags & PADDED:
        pad, payload = payload[0], payload[1:]
    if f.flags & PRIORITY:
        payload = payload[5:]
    return payload[:len(payload) - pad] if pad else payload


#: RFC 7541 Appendix A (index 1 first).
STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = (
    (b":authority", b""), (b":method", b"GET"), (b":method", b"POST"), (b":path", b"/"),
    (b":path", b"/index.html"), (b":scheme", b"http"), (b":scheme", b"https"),
    (b":status", b"200"), (b":status", b"204"), (b":status", b"206"), (b":status", b"304"),
    (b":status", b"400"), (b":status", b"404"), (b":status", b"500"),
    *((name, b"gzip, deflate" if name == b"accept-encoding" else b"") for name in (
        b"accept-charset", b"accept-encoding", b"accept-language", b"accept-ranges", b"accept",
        b"access-control-allow-origin", b"age", b"allow", b"authorization", b"cache-control",
        b"content-disposition", b"content-encoding", b"content-language", b"content-length",
        b"content-location", b"content-range", b"content-type", b"cookie", b"date", b"etag",
        b"expect", b"expires", b"from", b"host", b"if-match", b"if-modified-since",
        b"if-none-match", b"if-range", b"if-unmodified-since", b"last-modified", b"link",
        b"location", b"max-forwards", b"proxy-authenticate", b"proxy-authorization", b"range",
        b"referer", b"refresh", b"retry-after", b"server", b"set-cookie",
        b"strict-transport-security", b"transfer-encoding", b"user-agent", b"vary", b"via",
        b"www-authenticate")),
)


class HeaderDecoder:
    """An HPACK decoder for one connection's received header blocks, in their order (the
    dynamic table is the connection's). No Huffman: such a string decodes as ``None``."""

    def __init__(self, max_size: int = 4096) -> None:
        self._dynamic: list[tuple[bytes | None, bytes | None]] = []  # newest first
        self._size = 0
        self._max = max_size

    def decode(self, block: bytes) -> list[tuple[bytes | None, bytes | None]]:
        fields: list[tuple[bytes | None, bytes | None]] = []
        pos = 0
        while pos < len(block):
            byte = block[pos]
            if byte & 0x80:  # indexed field
                index, pos = _read_int(block, pos, 7)
                fields.append(self._entry(index))
            elif byte & 0x40:  # literal with incremental indexing
                field, pos = self._literal(block, pos, 6)
                fields.append(field)
                self._insert(field)
            elif byte & 0x20:  # dynamic table size update
                self._max, pos = _read_int(block, pos, 5)
                self._evict()
            else:  # literal without indexing / never indexed
                field, pos = self._literal(block, pos, 4)
                fields.append(field)
        return fields

    def _entry(self, index: int) -> tuple[bytes | None, bytes | None]:
        if 1 <= index <= len(STATIC_TABLE):
            return STATIC_TABLE[index - 1]
        at = index - len(STATIC_TABLE) - 1
        if 0 <= at < len(self._dynamic):
            return self._dynamic[at]
        raise ValueError(f"HPACK index {index} is in neither table")

    def _literal(self, block: bytes, pos: int,
                 prefix: int) -> tuple[tuple[bytes | None, bytes | None], int]:
        index, pos = _read_int(block, pos, prefix)
        if index:
            name: bytes | None = self._entry(index)[0]
        else:
            name, pos = _read_string(block, pos)
        value, pos = _read_string(block, pos)
        return (name, value), pos

    def _insert(self, field: tuple[bytes | None, bytes | None]) -> None:
        # an undecoded (Huffman) string's length is unknown: the table's size is then off,
        # which only matters if the server relies on an eviction; grpc core does not Huffman-code
        name, value = field
        self._dynamic.insert(0, field)
        self._size += 32 + len(name or b"") + len(value or b"")
        self._evict()

    def _evict(self) -> None:
        while self._size > self._max and self._dynamic:
            name, value = self._dynamic.pop()
            self._size -= 32 + len(name or b"") + len(value or b"")


def _read_int(block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    limit = (1 << prefix_bits) - 1
    value = block[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    while True:
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _read_string(block: bytes, pos: int) -> tuple[bytes | None, int]:
    huffman = bool(block[pos] & 0x80)
    length, pos = _read_int(block, pos, 7)
    data = block[pos:pos + length]
    return (None if huffman else bytes(data)), pos + length
