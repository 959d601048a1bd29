"""The producer side of the check-back (RocketMQ's ``checkLocalTransaction``), over signed HTTP.

When a transaction stays ``prepared`` too long, the sidecar's checker POSTs a signed
``CheckRequest`` to the producer group's endpoint; the application's resolver looks at its own
database and answers COMMIT, ROLLBACK or UNKNOWN, signed. Serve it with ``serve`` (standard library
HTTP server) or mount ``asgi_app``; the checker builds requests with ``build_request`` and checks
answers with ``verify_response``. Wire contract: ``openapi.yaml`` in this package.
"""

from ._asgi import asgi_app
from ._handler import (
    AsyncCheckHandler,
    AsyncResolver,
    CheckHandler,
    HandlerResult,
    Resolver,
)
from ._protocol import (
    PROTOCOL_VERSION,
    CheckRecord,
    CheckRequest,
    CheckResponse,
    TransactionStatus,
    build_request,
    build_response,
    new_message_id,
    verify_response,
)
from ._server import RunningServer, serve
from ._signing import (
    HEADER_ID,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    AuthenticationFailed,
    CheckbackError,
    InMemoryReplayCache,
    MalformedRequest,
    MalformedResponse,
    ReplayCache,
    ReplayedMessage,
    ResponseMismatch,
    Secret,
    SignatureInvalid,
    SignatureMissing,
    Signer,
    TimestampOutsideTolerance,
    Verifier,
    generate_secret,
)

__all__ = [
    "HEADER_ID",
    "HEADER_SIGNATURE",
    "HEADER_TIMESTAMP",
    "PROTOCOL_VERSION",
    "AsyncCheckHandler",
    "AsyncResolver",
    "AuthenticationFailed",
    "CheckHandler",
    "CheckRecord",
    "CheckRequest",
    "CheckResponse",
    "CheckbackError",
    "HandlerResult",
    "InMemoryReplayCache",
    "MalformedRequest",
    "MalformedResponse",
    "ReplayCache",
    "ReplayedMessage",
    "Resolver",
    "ResponseMismatch",
    "RunningServer",
    "Secret",
    "SignatureInvalid",
    "SignatureMissing",
    "Signer",
    "TimestampOutsideTolerance",
    "TransactionStatus",
    "Verifier",
    "asgi_app",
    "build_request",
    "build_response",
    "generate_secret",
    "new_message_id",
    "serve",
    "verify_response",
]
