"""glibc's malloc set for a CPU engine's activations.

A prefill step's temporaries are tens of MB (a 4,096-token step's gate/up output is 25 MB in
SmolLM2-135M, 134 MB in a 1B model). glibc serves such sizes by mmap until its dynamic
threshold has grown past them, and hands the top of its heap back to the OS whenever more than
its trim threshold is free: either way the next step's tensors land on fresh pages, which the
kernel faults in and zeroes inside the GEMM that writes them. On a 2-core Zen 5, a fresh
engine's shared-prefix 8 x 8 run had its 4,096-token steps' gate/up GEMMs at 16-72 ms (18 ms
alone); with both thresholds raised the first run took 9.6-10.2 s instead of 10.6-12.4 s
(later runs, once glibc had adapted, alike). So allocations up to MMAP_THRESHOLD come from the
heap and freed memory stays with the process, as a serving engine's memory does anyway.

Variables the user set (MALLOC_*_, GLIBC_TUNABLES) win: nothing is changed then.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 1 << 30
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                 "GLIBC_TUNABLES")


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process -> whether they are set (False
    without glibc, or where the user's environment already configures malloc)."""
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not done:
        logger.info("glibc refused the malloc thresholds; activations may fault in fresh pages")
    return done
