"""The relay's queue of upstream chunks (gateway/proxy/relay.py): one producer — the pump task or the network
tap's callback — and the relay task as its one consumer."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Generic, TypeVar

from kvscope.gateway.proxy.network import wait_future

T = TypeVar("T")


class ChunkQueue(Generic[T]):
    """The pump's chunks for the relay: a bounded FIFO with one producer and one consumer, bound to the
    loop it was made on. :meth:`get` waits with a deadline through one future and one timer
    (:func:`kvscope.gateway.proxy.network.wait_future`; ``asyncio.Queue`` asks the running loop per wait
    too)."""

    def __init__(self, maxsize: int = 64) -> None:
        self._loop = asyncio.get_running_loop()
        self._items: collections.deque[T] = collections.deque()
        self._maxsize = maxsize
        self._getter: asyncio.Future[None] | None = None
        self._putter: asyncio.Future[None] | None = None
        self.on_room: Callable[[], None] | None = None
        """Called by :meth:`get` when :meth:`offer` had filled the queue and there is room again."""
        self._full = False

    def offer(self, item: T) -> bool:
        """Append ``item`` without waiting (a producer that cannot wait: the network tap); returns whether
        there is room for more (False: stop producing until :attr:`on_room` is called)."""
        self._items.append(item)
        if self._getter is not None and not self._getter.done():
            self._getter.set_result(None)
        self._full = len(self._items) >= self._maxsize
        return not self._full

    def __len__(self) -> int:
        return len(self._items)

    async def put(self, item: T) -> None:
        """Append ``item``, waiting while ``maxsize`` items are queued."""
        while len(self._items) >= self._maxsize:
            self._putter = self._loop.create_future()
            try:
                await self._putter
            finally:
                self._putter = None
        self.offer(item)

    async def get(self, timeout: float | None = None) -> T:
        """The oldest item, waiting at most ``timeout`` seconds (None: no limit); TimeoutError after it."""
        if not self._items:
            self._getter = self._loop.create_future()
            try:
                await wait_future(self._getter, timeout, TimeoutError)
            finally:
                self._getter = None
        item = self._items.popleft()
        if self._putter is not None and not self._putter.done():
            self._putter.set_result(None)
        if self._full and len(self._items) <= self._maxsize // 2 and self.on_room is not None:
            self._full = False
            self.on_room()
        return item
