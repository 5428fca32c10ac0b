"""Where the Triton tests run: the GPU when there is one, else Triton's interpreter. Import it
before anything imports triton: the interpreter is chosen at decoration time, from
TRITON_INTERPRET, which this sets on a machine without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"


def skip_if_compiled_without_gpu() -> None:
    """Skip the calling test module where the kernels were decorated before this module set
    the interpreter (another import got to triton first): they could not run on CPU."""
    from banyan.kernels import triton_attention

    if DEVICE == "cpu" and not triton_attention.INTERPRETED:
        pytest.skip("the Triton kernels were imported before TRITON_INTERPRET was set",
                    allow_module_level=True)
