"""Whose key an address carries, by the name the cluster's key ring gives it.

What decides, with keys, that a reply comes from the runtime its call went to, and that a
request's reply address is its caller's own (docs/security.md): a reply from any other key
(a guessed call id, or a request that named another runtime's address for its reply) is never
taken for the answer, and no runtime answers to an address that is not its caller's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from actors._calls import PendingCalls
from transport.security import Gate, shown, split_address
from transport.wire import excerpt

__all__ = ["LONGEST", "KeyNames", "key_name", "reply_route"]

log = logging.getLogger(__name__)

# Names, methods, keyword names and addresses are short: a longer one is refused before it is
# quoted anywhere (error messages repr the name and method).
LONGEST = 1024

# The most addresses whose key's name a runtime keeps (beyond it, it starts again).
_MAX_NAMES = 4096


def key_name(address: str, gate: Gate | None) -> str | None:
    """The name ``gate``'s key ring gives the key in ``address`` (None: no keys, or none there)."""
    try:
        key = split_address(address)[1]
    except ValueError:
        return None
    return gate.name_of(key) if gate is not None and key is not None else None


def reply_route(message: dict[str, Any]) -> tuple[str, int] | None:
    """Where a request's answer goes (its reply address and call id), where it says so in a well-formed way."""
    call_id, reply_to = message.get("id"), message.get("r")
    return (reply_to, call_id) if isinstance(reply_to, str) and len(reply_to) <= LONGEST and isinstance(
        call_id, int) else None


class KeyNames:
    """A runtime's view of whose key each address carries (``gate``: its key ring; None: no keys, and
    every peer is trusted). An address's name is kept, since every reply and request asks (a split
    address and a ring read cost micro-seconds), and looked up again before it says no, so a key
    named anew is not refused on an old name."""

    def __init__(self, gate: Gate | None) -> None:
        self._gate = gate
        self._names: dict[str, str | None] = {}

    def holds(self, address: str, name: str) -> bool:
        """Whether the key in ``address`` is the one the ring names ``name`` (always, without keys)."""
        if self._gate is None or self._names.get(address) == name:
            return True
        found = key_name(address, self._gate)
        if len(self._names) >= _MAX_NAMES:
            self._names.clear()
        self._names[address] = found
        return found == name

    def route(self, message: dict[str, Any], caller: str) -> tuple[str, int] | None:
        """:func:`reply_route`, where the reply address is ``caller``'s own (one that carries its key); a
        request that names another is logged (the caller drops it)."""
        route = reply_route(message)
        if route is None or self.holds(route[0], caller):
            return route
        log.warning("a request from %s to %s.%s names %s for its reply, not its own address", excerpt(caller, 80),
                    excerpt(message.get("to")), excerpt(message.get("m")), excerpt(route[0], 120))
        return None

    def answered(self, calls: PendingCalls, message: dict[str, Any], sender: str) -> asyncio.Future[Any] | None:
        """The call in ``calls`` a reply from ``sender`` answers: one that waits, and went to ``sender``."""
        waiting = calls.waiting(message.get("id"))
        if waiting is None:
            log.debug("reply %s came after its caller stopped waiting", excerpt(message.get("id")))
            return None
        future, address = waiting
        if not self.holds(address, sender):
            log.warning("dropped a reply from %s to call %s, which went to %s", excerpt(sender, 80),
                        excerpt(message.get("id")), shown(address))
            return None
        return future
