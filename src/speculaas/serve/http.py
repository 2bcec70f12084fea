"""The HTTP protocol the servers run: uvicorn's h11 protocol with a deadline on each request's
head. uvicorn times out idle keep-alive connections but not a connection that never sends, or
sends half of its request line and headers: each such socket would be held for as long as the
client likes (a few hundred exhaust the process's file descriptors). Here a connection whose
request head is not complete `timeout_s` after it opened, or after its previous response, is
closed."""

from __future__ import annotations

import logging

LOG = logging.getLogger("speculaas.serve")
HEADER_TIMEOUT_S = 10.0


def header_timeout_protocol(timeout_s: float = HEADER_TIMEOUT_S) -> type:
    """An asyncio protocol class for uvicorn.Config(http=...)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        _head_timer = None

        def connection_made(self, transport) -> None:  # noqa: ANN001
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first bytes of the next request on a kept-alive connection
            super().data_received(data)

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:  # a request's head arrived whole
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._disarm()  # idle again: uvicorn's keep-alive timeout takes over

        def connection_lost(self, exc) -> None:  # noqa: ANN001
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expired(self) -> None:
            self._head_timer = None
            if self.cycle is None or self.cycle.response_complete:
                client = "%s:%d" % self.client if self.client else "a client"
                LOG.info("%s sent no complete request head in %.0f s; connection closed",
                         client, timeout_s)
                self.transport.close()

    return HeaderTimeoutProtocol
