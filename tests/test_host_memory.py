"""glibc malloc thresholds for CPU activations (runner/host_memory.py): a freed step-sized
tensor's pages are reused by the next step instead of faulted in again, and the user's own
malloc settings are left alone."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

on_glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                              reason="glibc's mallopt")

# Allocate, touch and free a 25 MB tensor (a 4,096-token gate/up output of SmolLM2), then count
# the minor page faults of doing it again, three times.
PROBE = """
import resource, sys, torch
from banyan.runner.host_memory import keep_freed_memory
set_ = keep_freed_memory() if sys.argv[1] == "tuned" else None
def step():
    t = torch.empty(25 << 20, dtype=torch.uint8)
    t.fill_(1)
    del t
step()
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(set_, *faults)
"""


def _probe(mode: str, env: dict[str, str] | None = None) -> tuple[str, list[int]]:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})}, check=True)
    setting, *faults = done.stdout.split()
    return setting, [int(f) for f in faults]


@on_glibc
def test_a_freed_step_tensor_is_reused_without_page_faults() -> None:
    setting, tuned = _probe("tuned")
    _, default = _probe("default")
    assert setting == "True"
    pages = (25 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert default[0] > pages // 2, f"glibc's defaults faulted only {default}: nothing to show"
    # The best of three repeats: on a Zen 4 VM one repeat in a process (the second or third)
    # sometimes faulted the whole tensor in again even so, once, and none after it; which of
    # them was not reproducible.
    assert min(tuned) < pages // 20, f"{tuned} faults for a tensor the heap kept"
    assert sorted(tuned)[1] < pages // 20, f"{tuned}: the heap kept the tensor only once"


@on_glibc
def test_the_users_malloc_settings_win() -> None:
    setting, _ = _probe("tuned", {"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert setting == "False"
