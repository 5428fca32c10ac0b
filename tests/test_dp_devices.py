"""--dp N: one GPU per replica on a CUDA machine, the CPU otherwise."""

from __future__ import annotations

import pytest

from banyan.router.launch import replica_devices


def test_cpu_replicas_share_the_cpu() -> None:
    assert replica_devices("cpu", 3, cuda_count=2) == ["cpu"] * 3
    assert replica_devices("auto", 2, cuda_count=0) == ["auto"] * 2


def test_each_replica_its_own_gpu() -> None:
    assert replica_devices("auto", 2, cuda_count=4) == ["cuda:0", "cuda:1"]
    assert replica_devices("cuda", 3, cuda_count=3) == ["cuda:0", "cuda:1", "cuda:2"]
    assert replica_devices("cuda:1", 1, cuda_count=2) == ["cuda:1"]
    with pytest.raises(ValueError, match="needs 4 GPUs, this machine has 2"):
        replica_devices("cuda", 4, cuda_count=2)
    with pytest.raises(ValueError, match="not cuda:1"):
        replica_devices("cuda:1", 2, cuda_count=2)
