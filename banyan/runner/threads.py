"""How many CPU threads a step uses when the machine is shared.

The kernels and torch's OpenMP teams meet at a barrier after every operation, hundreds of
times per decode step. When another process holds a core, the thread that lost it stalls the
barrier for a whole scheduler slice while the others spin: a 2-thread batch-1 decode fell from
135 to ~27 tok/s beside a 2-thread matmul loop, and one thread kept 46-78 (the figures are in
docs/performance.md). So with no --num-threads, the engine looks every quarter second at how
much CPU the rest of the machine used (/proc/stat's busy time less this process's own) and runs
the next steps on the cores left over, at least one; when the others go quiet it takes the cores
back. Outputs do not depend on this: every kernel gives the same bits on any thread count.

A window through which this process sat idle is not trusted to give cores up: the engine idles
while its requests come from elsewhere, and what ran then may have just ended (another engine's
run in a benchmark that alternates engines). Judged on such a window, the next step ran on one
thread: a shared-prefix 8 x 8 run's first 4,096-token prefill step took 5.4 s instead of 2.8,
every harness run ~20% slower than the same engine run twice in a row. So the count drops only
if a fresh look of CONFIRM_S agrees.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)

INTERVAL_S = 0.25  # how often the machine's load is read: a few dozen decode steps
DROP_AT = 0.5  # others hold at least half a core of ours: give it up
TAKE_AT = 0.75  # a core stays this free (others use <= 0.25 of it): take it back
IDLE_AT = 0.5  # this process used less than half a core over the window: it sat idle
CONFIRM_S = 0.05  # the fresh look (5 clock ticks a core of /proc/stat's 10 ms)


def read_busy_seconds() -> float | None:
    """CPU seconds the whole machine spent busy since boot (all cores; steal counts: the
    hypervisor gave that time to someone else), or None where /proc/stat is missing."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_busy_seconds() -> float:
    t = os.times()
    return t.user + t.system


class ThreadGovernor:
    """`threads()` before each step: the thread count that step should use."""

    def __init__(self, max_threads: int, cores: int | None = None,
                 machine_busy: Callable[[], float | None] = read_busy_seconds,
                 own_busy: Callable[[], float] = own_busy_seconds,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.max_threads = max(1, max_threads)
        self.cores = cores if cores is not None else len(os.sched_getaffinity(0))
        self.current = self.max_threads
        self.others = 0.0  # cores the rest of the machine used over the last interval
        self._machine_busy, self._own_busy, self._clock = machine_busy, own_busy, clock
        self._sleep = sleep
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        machine = self._machine_busy()
        return None if machine is None else (self._clock(), machine, self._own_busy())

    def threads(self) -> int:
        if self._last is None or self._clock() - self._last[0] < INTERVAL_S:
            return self.current
        now = self._sample()
        assert now is not None
        others, own = _rates(self._last, now)
        self._last = now
        if own < IDLE_AT and self._chosen(others) < self.current:
            self._sleep(CONFIRM_S)  # idle through it: do the others still run?
            fresh = self._sample()
            assert fresh is not None
            others, _ = _rates(now, fresh)
            self._last = fresh
        self.others = others
        chosen = self._chosen(others)
        if chosen != self.current:
            logger.info("other processes use %.1f of %d cores: steps now run on %d thread%s",
                        self.others, self.cores, chosen, "" if chosen == 1 else "s")
            self.current = chosen
        return self.current

    def _chosen(self, others: float) -> int:
        """The count for a window in which the other processes used `others` cores."""
        free = self.cores - others
        if free <= self.current - DROP_AT:
            return max(1, math.floor(free + 0.5))
        if free >= self.current + TAKE_AT:
            return min(self.max_threads, math.floor(free + 0.25))
        return self.current

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The step's thread count on the calling thread (OpenMP's count is per thread) while a
        step runs, the previous one restored after it: an offline Engine runs its steps on the
        user's own thread, whose torch work and later engines' start-up must not see it."""
        threads, before = self.threads(), torch.get_num_threads()
        if threads == before:
            yield
            return
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)


def _rates(before: tuple[float, float, float], after: tuple[float, float, float]
           ) -> tuple[float, float]:
    """Cores the other processes and this one used between two samples (clock, machine busy,
    own busy)."""
    wall = max(after[0] - before[0], 1e-9)
    own = (after[2] - before[2]) / wall
    return max(0.0, (after[1] - before[1]) / wall - own), own
