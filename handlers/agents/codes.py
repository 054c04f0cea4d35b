"""gRPC status codes under grpc-go's names, as the Go version's metrics labelled them.

Why here: the agent client's ``agent_rpc_requests_total`` and the server's request metrics
both label codes the way Go's ``codes.Code.String()`` spells them (``OK``, ``NotFound``,
``Canceled``), so a Go dashboard's ``code="Unavailable"`` matches. The agent client is the
lower of the two users, so the table lives with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import grpc

_S = grpc.StatusCode
#: grpc-go's names of the status codes (``codes.Code.String()``)
GO_CODE_NAMES: Mapping[grpc.StatusCode, str] = MappingProxyType({
    _S.OK: "OK", _S.CANCELLED: "Canceled", _S.UNKNOWN: "Unknown",
    _S.INVALID_ARGUMENT: "InvalidArgument", _S.DEADLINE_EXCEEDED: "DeadlineExceeded",
    _S.NOT_FOUND: "NotFound", _S.ALREADY_EXISTS: "AlreadyExists",
    _S.PERMISSION_DENIED: "PermissionDenied", _S.RESOURCE_EXHAUSTED: "ResourceExhausted",
    _S.FAILED_PRECONDITION: "FailedPrecondition", _S.ABORTED: "Aborted",
    _S.OUT_OF_RANGE: "OutOfRange", _S.UNIMPLEMENTED: "Unimplemented", _S.INTERNAL: "Internal",
    _S.UNAVAILABLE: "Unavailable", _S.DATA_LOSS: "DataLoss",
    _S.UNAUTHENTICATED: "Unauthenticated",
})


def go_code(code: grpc.StatusCode) -> str:
    """``code`` as the Go version's metrics labelled it."""
    return GO_CODE_NAMES[code]
