"""The one exception type of the gateway, on both sides of the wire.

`GatewayError.code` is the name of a gRPC status code (`grpc.StatusCode[code]`), so the server
maps it to a status without this module importing grpc, and the client raises the same type
for any failed call.
"""

from __future__ import annotations

INVALID_ARGUMENT = "INVALID_ARGUMENT"
NOT_FOUND = "NOT_FOUND"
ALREADY_EXISTS = "ALREADY_EXISTS"
FAILED_PRECONDITION = "FAILED_PRECONDITION"
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
UNAUTHENTICATED = "UNAUTHENTICATED"
PERMISSION_DENIED = "PERMISSION_DENIED"
UNAVAILABLE = "UNAVAILABLE"
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
INTERNAL = "INTERNAL"


class GatewayError(Exception):
    """A refused or failed gateway call.

    Attributes:
        code: a gRPC status code name, e.g. "INVALID_ARGUMENT", "UNAUTHENTICATED".
        message: what was expected and what came.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def invalid(message: str) -> GatewayError:
    """Shorthand for an INVALID_ARGUMENT error with `message`."""
    return GatewayError(INVALID_ARGUMENT, message)


SHOWN_CHARS = 64  # longest piece of a caller's input a message repeats
MAX_MESSAGE_CHARS = 1000  # longest refusal message sent back (well under 1 KB)


def shown(value: object) -> str:
    """`repr(value)`, cut to `SHOWN_CHARS` characters with the count of those left out, e.g.
    `'aaaa…'(+999960 chars)`: a refusal repeats at most this much of what a caller sent."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}…(+{len(text) - SHOWN_CHARS} chars)"


def clip(message: str) -> str:
    """`message` cut to `MAX_MESSAGE_CHARS` characters (the last one '…' when cut)."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 1] + "…"
