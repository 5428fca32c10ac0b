"""Requests waiting for their grammar: held outside the scheduler until it is compiled, so the
step loop never blocks on a compile and a slow grammar delays only its own request."""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from banyan.scheduler.request import Request
from banyan.structured.grammar import GrammarBackend
from banyan.structured.spec import StructuredSpec


@dataclass(slots=True)
class _Waiting:
    future: Future[Any]
    children: list[Request]  # the n samples of one request, each gets its own matcher
    deadline: float


@dataclass(slots=True)
class GrammarWaitlist:
    backend: GrammarBackend
    timeout_s: float
    _items: list[_Waiting] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, spec: StructuredSpec, children: list[Request]) -> None:
        self._items.append(_Waiting(self.backend.submit(spec), children,
                                    time.monotonic() + self.timeout_s))

    def rids(self) -> list[str]:
        return [r.rid for item in self._items for r in item.children]

    def remove(self, rid: str) -> Request | None:
        """Take one sample out (an abort); the compile goes on for the cache's sake."""
        for item in self._items:
            for req in item.children:
                if req.rid == rid:
                    item.children.remove(req)
                    if not item.children:
                        self._items.remove(item)
                    return req
        return None

    def collect(self, block_s: float = 0.0) -> tuple[list[Request], list[tuple[Request, str]]]:
        """(requests whose grammar is ready, each with its matcher attached; (request, error)
        for compiles that failed or ran out of time). block_s: wait up to this long for one
        compile when nothing else is to be done (the loop would only spin)."""
        if block_s > 0 and self._items:
            wait_futures([i.future for i in self._items], timeout=block_s,
                         return_when="FIRST_COMPLETED")
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        now = time.monotonic()
        keep: list[_Waiting] = []
        for item in self._items:
            if item.future.done():
                error = item.future.exception()
                if error is not None:
                    failed += [(r, f"grammar compilation failed: {error}") for r in item.children]
                    continue
                compiled = item.future.result()
                for req in item.children:
                    req.grammar = self.backend.new_state(compiled)
                ready += item.children
            elif now > item.deadline:
                late = (f"grammar compilation took longer than {self.timeout_s:g} s "
                        "(--grammar-compile-timeout)")
                failed += [(r, late) for r in item.children]
            else:
                keep.append(item)
        self._items = keep
        return ready, failed
