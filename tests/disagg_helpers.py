"""Shared by the prefill/decode disaggregation tests: which K/V transfer backends this machine
can run."""

from __future__ import annotations

import pytest


def has_mooncake() -> bool:
    try:
        import mooncake.engine  # noqa: F401  (needs libibverbs1 even for TCP)
    except (ImportError, OSError):
        return False
    return True


# Parametrize over these: the mooncake case is skipped where its transfer engine cannot load.
BACKENDS = ["zmq", pytest.param("mooncake", marks=pytest.mark.skipif(
    not has_mooncake(), reason="mooncake-transfer-engine-non-cuda (and libibverbs1) missing"))]
