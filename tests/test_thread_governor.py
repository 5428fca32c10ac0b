"""The step thread count on a shared CPU: fewer threads while other processes hold cores, the
cores taken back when they go quiet, and not one output bit changed by the switching."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from banyan import Engine
from banyan.runner.step import ModelStepRunner
from banyan.runner.threads import (
    INTERVAL_S,
    ThreadGovernor,
    own_busy_seconds,
    read_busy_seconds,
)
from banyan.sampling.params import SamplingParams


class FakeMachine:
    """A clock and busy-time counters the test advances: `run(seconds, others, own)` is a
    stretch in which the other processes used `others` cores and this one `own`."""

    def __init__(self) -> None:
        self.now, self.machine, self.own = 100.0, 5_000.0, 40.0
        self.sleeps: list[float] = []
        self.others_while_asleep = 0.0  # what the other processes do in the governor's sleep

    def run(self, seconds: float, others: float, own: float = 1.0) -> None:
        self.now += seconds
        self.machine += (others + own) * seconds
        self.own += own * seconds

    def governor(self, max_threads: int, cores: int) -> ThreadGovernor:
        return ThreadGovernor(max_threads, cores, machine_busy=lambda: self.machine,
                              own_busy=lambda: self.own, clock=lambda: self.now,
                              sleep=self.sleep)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.run(seconds, others=self.others_while_asleep, own=0.0)


def test_other_processes_take_cores_and_give_them_back() -> None:
    m = FakeMachine()
    gov = m.governor(max_threads=2, cores=2)
    assert gov.threads() == 2
    m.run(0.1, others=1.0)
    assert gov.threads() == 2, "read only once a quarter second has passed"
    m.run(INTERVAL_S, others=1.0)
    assert gov.threads() == 1 and gov.others == pytest.approx(1.0)
    m.run(INTERVAL_S, others=0.9)  # the competitor still holds its core
    assert gov.threads() == 1
    m.run(INTERVAL_S, others=0.4)  # between the marks: no flapping
    assert gov.threads() == 1
    m.run(INTERVAL_S, others=0.15)  # an API server streaming beside us
    assert gov.threads() == 2
    m.run(INTERVAL_S, others=0.3)
    assert gov.threads() == 2
    m.run(INTERVAL_S, others=3.0)  # more than all cores: still one thread
    assert gov.threads() == 1


def test_load_seen_while_idle_gives_up_cores_only_if_it_still_runs() -> None:
    """The engine idled while another process computed (another engine's run in a benchmark
    that alternates them): that load may have just ended, so a fresh look decides."""
    m = FakeMachine()
    gov = m.governor(max_threads=2, cores=2)
    m.run(20.0, others=2.0, own=0.0)  # it has ended: the fresh look sees the machine quiet
    assert gov.threads() == 2 and len(m.sleeps) == 1
    m.run(20.0, others=2.0, own=0.0)
    m.others_while_asleep = 1.9  # it still runs
    assert gov.threads() == 1 and len(m.sleeps) == 2
    assert gov.others == pytest.approx(1.9)
    m.others_while_asleep = 0.0
    m.run(INTERVAL_S, others=0.0, own=1.0)
    assert gov.threads() == 2, "taking cores back needs no second look"
    m.run(INTERVAL_S, others=1.0, own=2.0)  # busy itself: the window is current
    assert gov.threads() == 1 and len(m.sleeps) == 2


def test_a_big_machine_gives_up_only_what_others_use() -> None:
    m = FakeMachine()
    gov = m.governor(max_threads=16, cores=16)
    m.run(INTERVAL_S, others=3.2)
    assert gov.threads() == 13
    m.run(INTERVAL_S, others=0.0)
    assert gov.threads() == 16, "never more than the starting count"


def test_without_proc_stat_the_count_stays() -> None:
    gov = ThreadGovernor(2, 2, machine_busy=lambda: None)
    assert gov.threads() == 2


@pytest.mark.skipif(read_busy_seconds() is None, reason="no /proc/stat")
def test_the_machines_busy_time_includes_this_process() -> None:
    machine0, own0 = read_busy_seconds(), own_busy_seconds()
    x = 0
    for i in range(6_000_000):  # a few tenths of a second of this process's CPU
        x += i
    machine1, own1 = read_busy_seconds(), own_busy_seconds()
    assert machine0 is not None and machine1 is not None
    assert own1 - own0 > 0.1
    assert machine1 - machine0 >= (own1 - own0) - 0.05  # clock-tick granularity


class Alternating(ThreadGovernor):
    """A governor over a machine whose other processes flip between all cores and none every
    interval, so the engine switches its thread count every few steps; it records its choices."""

    def __init__(self) -> None:
        self.calls, self.now, self.machine = 0, 0.0, 0.0
        self.chosen: set[int] = set()
        # busy itself (a core's worth: its windows are current, taken as they are)
        super().__init__(2, 2, machine_busy=self.busy, own_busy=lambda: self.now,
                         clock=self.clock)

    def threads(self) -> int:
        n = super().threads()
        self.chosen.add(n)
        return n

    def clock(self) -> float:
        self.now += INTERVAL_S / 2
        return self.now

    def busy(self) -> float:
        self.calls += 1
        self.machine += 2.0 * INTERVAL_S if self.calls % 2 else 0.0
        return self.machine + self.now


def _generate(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_new_tokens=24, temperature=0, logprobs=2, ignore_eos=True)
    lone = engine.generate(input_ids=prompts[:1], sampling_params=params, use_tqdm=False)
    batch = engine.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    return [(o.output_ids, [lp.logprob for lp in o.outputs[0].logprobs or []]
             + [x for lp in o.outputs[0].logprobs or [] for x in lp.top_logprobs])
            for o in lone + batch]


def test_switching_threads_between_steps_changes_no_output_bit(llama_dir: Path) -> None:
    """A lone long decode (its keys split into parts) and a batch, greedy with logprobs: a
    governor that flips between 1 and 2 threads gives exactly the floats of a fixed count."""
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (700, 40, 300)]
    before = torch.get_num_threads()
    try:
        with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                    num_threads=2) as engine:
            fixed = _generate(engine, prompts)
        with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                    num_threads=2) as engine:
            runner = engine.core.scheduler.runner
            assert isinstance(runner, ModelStepRunner) and runner.governor is None
            runner.governor = governor = Alternating()
            governed = _generate(engine, prompts)
    finally:
        torch.set_num_threads(before)
    assert governor.chosen == {1, 2}
    assert governed == fixed


def test_the_engine_is_governed_unless_threads_are_fixed(llama_dir: Path) -> None:
    before = torch.get_num_threads()
    try:
        for threads, governed in ((None, True), (1, False)):
            with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                        num_threads=threads) as engine:
                runner = engine.core.scheduler.runner
                assert isinstance(runner, ModelStepRunner)
                assert (runner.governor is not None) == governed
    finally:
        torch.set_num_threads(before)


def test_the_callers_thread_count_is_restored_after_each_step(llama_dir: Path) -> None:
    """An offline Engine steps on the user's thread: a step may run on fewer threads, but the
    user's own torch work (and the next engine's kernel choices) see the count as it was."""
    m = FakeMachine()
    before = torch.get_num_threads()
    try:
        with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                    num_threads=2) as engine:
            runner = engine.core.scheduler.runner
            assert isinstance(runner, ModelStepRunner)
            runner.governor = governor = m.governor(max_threads=2, cores=2)
            m.run(INTERVAL_S, others=2.0)  # the machine is busy: steps run on one thread
            seen: list[int] = []
            compute = runner._compute_step

            def spy(*args: object) -> object:
                seen.append(torch.get_num_threads())
                return compute(*args)  # type: ignore[arg-type]

            runner._compute_step = spy  # type: ignore[method-assign]
            params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
            engine.generate(input_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False)
            assert governor.current == 1 and set(seen) == {1}
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
