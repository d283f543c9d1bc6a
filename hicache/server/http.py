"""uvicorn's HTTP/1.1 protocol (h11) with deadlines for reading a request.

uvicorn closes a keep-alive connection that stays idle between requests, but it waits for a request's headers
and body as long as the client likes: 300 connections each sending half a header held 300 sockets and their
buffers for as long as they were open (slowloris). Here a request's headers must be complete within
`server.header_timeout_s` of their first byte (or of the connection), and its body within
`server.body_timeout_s` of the headers; past either, the connection is closed. A client that sends slowly but
steadily is cut off too: the deadline is for the whole read, not for each byte.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


def bounded_h11(header_timeout_s: float, body_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol class with these read deadlines, for `uvicorn.Config(http=...)`."""

    class BoundedH11Protocol(H11Protocol):
        """H11Protocol closing a connection whose request headers or body do not arrive in time."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._read_phase: str | None = None
            self._read_timer: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._follow()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._follow()

        def connection_lost(self, exc: Exception | None) -> None:
            self._arm(None)
            super().connection_lost(exc)

        def _follow(self) -> None:
            """Arm the deadline of what the connection now waits for from the client: headers (a request not
            started, some of it received or the connection new), a body, or nothing."""
            state = self.conn.their_state
            phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
            if phase != self._read_phase:
                self._arm(phase)

        def _arm(self, phase: str | None) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None
            self._read_phase = phase
            if phase is not None:
                timeout = header_timeout_s if phase == "headers" else body_timeout_s
                self._read_timer = self.loop.call_later(timeout, self._expire, phase, timeout)

        def _expire(self, phase: str, timeout: float) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            logger.info("closing the connection of %s: its request %s did not arrive within %g s", client, phase,
                        timeout)
            self.transport.close()

    return BoundedH11Protocol


def protocol_options(header_timeout_s: float, body_timeout_s: float) -> dict[str, Any]:
    """uvicorn.Config keyword arguments for the bounded protocol."""
    return {"http": bounded_h11(header_timeout_s, body_timeout_s)}
