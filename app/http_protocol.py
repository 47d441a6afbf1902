"""The HTTP/1.1 connection handling ``moco serve`` runs under uvicorn: its h11 protocol, plus a deadline for the
request head.

uvicorn closes an idle connection only after a response (its keep-alive timeout). A connection that opens and
sends nothing, or sends its request line and headers a few bytes at a time, was held forever: half-open
connections, and a slow client, each keep a socket and a file descriptor until the process runs out of them.
Here every connection must deliver a complete request head within :data:`HEAD_TIMEOUT_S` seconds of opening,
and of the end of its previous response; otherwise it is closed. A request's body and the response are not
limited (uploads stream in at the client's pace; their size is bounded elsewhere).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 10.0  # seconds a connection may take to send a request's head (line and headers)


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol that closes connections whose request head does not arrive in time."""

    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is complete: a request is under way
            self._cancel_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_deadline()  # the next request on this connection gets the same time

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        self._head_deadline = self.loop.call_later(HEAD_TIMEOUT_S, self._head_too_late)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_late(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def uvicorn_options() -> dict:
    """The options every uvicorn server of ``moco serve`` runs with (one process or ``--workers``)."""
    return {"http": HeadDeadlineProtocol, "log_level": "warning", "timeout_graceful_shutdown": 5}
