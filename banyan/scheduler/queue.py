"""The waiting queue and the order in which it is admitted."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from banyan.scheduler.request import Request


class WaitingQueue:
    """First come, first served; retracted requests go back to the front, since they had been
    admitted before anything still waiting."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def push(self, req: Request) -> None:
        self._queue.append(req)

    def push_front(self, req: Request) -> None:
        self._queue.appendleft(req)

    def remove(self, req: Request) -> None:
        self._queue.remove(req)
