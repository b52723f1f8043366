"""Who hears a publisher's events: the event sink, and subscriptions bound to the caller, bounded, filtered by owner.

The head (node events) and the scheduler (job events) keep their subscribers here.
A subscription is made inside an endpoint, and its subscriber is an actor (an
:class:`~actors.EventSink`) *in the runtime that called*, at that runtime's own
address (:meth:`Host.caller_address <actors.Host.caller_address>`: with keys, an
address that carries the caller's own public key). A caller names only its sink's
name, never where events go, so a publisher never connects out to an address a
caller picked, and whatever listens there proves it holds the caller's key.

Each key holds at most ``max_per_caller`` subscriptions and the publisher at most
``max_total``; one more is refused with :class:`~actors.TooManySubscribers`.
Subscribing the same sink again is no new subscription. A subscriber that does not
take an event within :attr:`Subscribers.notify_timeout_s` (gone, or not reading) is
dropped.

An event published with an ``owner`` (a job's events: the key that created the job)
reaches only the subscribers that :func:`~actors.may_see` what that key owns: the
owner, the admin key, the process itself, and anyone through a runtime without keys.
An event without one (a node joined, left or went silent) reaches every subscriber.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from actors._actor import INSECURE, Actor, Host, current_caller, endpoint, may_see
from actors._errors import TooManySubscribers
from actors.events import Event
from transport.wire import excerpt

__all__ = ["EventSink", "Subscriber", "Subscribers"]

log = logging.getLogger(__name__)

_MAX_NAME = 256  # an actor name a subscriber gives: short, like every name on the wire


class EventSink(Actor):
    """An actor that takes events and hands each to ``handler``: subscribe it to the
    head (``HeadActor.subscribe``) or to any publisher that tells ``on_event``."""

    def __init__(self, handler: Callable[[Event], None]) -> None:
        self.handler = handler

    @endpoint
    async def on_event(self, event: Event) -> None:
        self.handler(event)  # (the mailbox refused anything but an Event: see actors._actor)


@dataclass(frozen=True, slots=True, kw_only=True)
class Subscriber:
    """One subscription: actor ``actor`` at ``address``, made by the key ``caller`` (``role:name``)."""

    caller: str
    address: str
    actor: str

    @property
    def holder(self) -> str:
        """Whom the per-key bound counts it against: the key, or the address where there are no keys."""
        return self.caller if self.caller != INSECURE else self.address


class Subscribers:
    """The subscribers of one publisher (``publisher`` names it in messages).

    Args:
        max_per_caller: subscriptions one key may hold at once.
        max_total: subscriptions the publisher holds at once.
        notify_timeout_s: how long an event may wait for its subscriber before the subscriber is dropped.
    """

    def __init__(self, publisher: str, *, max_per_caller: int = 16, max_total: int = 256,
                 notify_timeout_s: float = 2.0) -> None:
        if max_per_caller < 1 or max_total < max_per_caller:
            raise ValueError(f"need 1 <= max_per_caller ({max_per_caller}) <= max_total ({max_total})")
        self.publisher = publisher
        self.max_per_caller = max_per_caller
        self.max_total = max_total
        self.notify_timeout_s = notify_timeout_s
        self._subscribers: dict[tuple[str, str], Subscriber] = {}  # by (address, actor)

    def __len__(self) -> int:
        return len(self._subscribers)

    def __iter__(self) -> Iterator[Subscriber]:
        return iter(list(self._subscribers.values()))

    def add(self, host: Host, actor: str) -> Subscriber:
        """Subscribes actor ``actor`` of the runtime that made the call being served.

        Raises:
            NotAllowed: the call came from no address of the caller's own (see :meth:`Host.caller_address`).
            ValueError: ``actor`` is not a name.
            TooManySubscribers: the caller's key, or the publisher, holds as many as it may.
        """
        subscriber = Subscriber(caller=current_caller(), address=host.caller_address(), actor=_name(actor))
        key = (subscriber.address, subscriber.actor)
        if key in self._subscribers:
            self._subscribers[key] = subscriber
            return subscriber
        held = Counter(s.holder for s in self._subscribers.values())
        if held[subscriber.holder] >= self.max_per_caller:
            raise TooManySubscribers(
                f"{excerpt(subscriber.holder, 80)} already holds {held[subscriber.holder]} subscriptions to the "
                f"{self.publisher}, the most one key may; unsubscribe one (or close a connection that holds one). "
                "A subscriber that stops taking events is dropped at the next event")
        if len(self._subscribers) >= self.max_total:
            raise TooManySubscribers(
                f"the {self.publisher} holds {len(self._subscribers)} subscriptions, the most it takes; try again "
                "once others unsubscribe (a subscriber that stops taking events is dropped at the next event)")
        self._subscribers[key] = subscriber
        return subscriber

    def remove(self, host: Host, actor: str) -> bool:
        """Ends the subscription of actor ``actor`` of the calling runtime (the caller's own, and only that).

        Returns:
            Whether there was one.

        Raises:
            NotAllowed: as for :meth:`add`.
        """
        return self._subscribers.pop((host.caller_address(), _name(actor)), None) is not None

    def publish(self, host: Host, event: Event, *, owner: str | None = None) -> int:
        """Tells ``event`` (with this clock's time) to every subscriber that may see it, without waiting.

        Args:
            owner: the key that owns what the event is about (a job's creator): only
                subscribers that :func:`~actors.may_see` its things hear it. None: everyone does.

        Returns:
            How many subscribers it was sent to.
        """
        if not event.time:  # stamped now, unless the publisher kept it stamped (as it also shows it elsewhere)
            event = dataclasses.replace(event, time=time.time())
        told = 0
        for subscriber in list(self._subscribers.values()):
            if owner is None or may_see(subscriber.caller, owner):
                host.spawn_task(self._notify(host, subscriber, event), name=f"{self.publisher} notify")
                told += 1
        return told

    async def _notify(self, host: Host, subscriber: Subscriber, event: Event) -> None:
        sink = host.ref(subscriber.address, subscriber.actor).endpoint(EventSink.on_event)
        try:
            await asyncio.wait_for(sink.tell(event), self.notify_timeout_s)
        except Exception:  # noqa: BLE001 - gone, slow or closing: a subscriber never breaks its publisher
            log.info("%s drops subscriber %s at %s: it does not take events", self.publisher,
                     excerpt(subscriber.actor, 60), excerpt(subscriber.address, 120))
            if self._subscribers.get((subscriber.address, subscriber.actor)) == subscriber:
                del self._subscribers[(subscriber.address, subscriber.actor)]


def _name(actor: object) -> str:
    if not isinstance(actor, str) or not 0 < len(actor) <= _MAX_NAME:
        raise ValueError(f"a subscriber is named by its actor's name (1 to {_MAX_NAME} characters), "
                         f"not {excerpt(actor, 60)}")
    return actor
