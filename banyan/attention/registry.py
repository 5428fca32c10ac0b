"""The attention-backend registry: `--attention-backend NAME` picks a class registered here.

A backend registers itself with `@register_backend("name")` where it is defined; `create_backend`
imports the modules that define backends, so asking for a name never depends on import order.
`auto` picks the fastest backend that works for the pool's device and dtype: on CUDA the Triton
kernels first; on CPU never them (there they run only under Triton's interpreter, a test tool).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from banyan.attention.base import AttentionBackend
    from banyan.mem.kv_pool import KVPool
    from banyan.mem.req_table import ReqToTokenTable

_BACKENDS: dict[str, type[AttentionBackend]] = {}
_MODULES = (
    "banyan.attention.torch_backend",
    "banyan.attention.cpu_native",
    "banyan.attention.triton_backend",
)
B = TypeVar("B", bound="type[AttentionBackend]")


def register_backend(name: str) -> Callable[[B], B]:
    def add(cls: B) -> B:
        if name in _BACKENDS and _BACKENDS[name] is not cls:
            raise ValueError(f"attention backend {name!r} registered twice")
        _BACKENDS[name] = cls
        cls.name = name
        return cls

    return add


def backend_names() -> list[str]:
    _import_all()
    return sorted(_BACKENDS)


def create_backend(name: str, pool: KVPool, table: ReqToTokenTable) -> AttentionBackend:
    """The backend `name` (or, for "auto", the first of the preferred ones that supports this
    pool) over `pool` and `table`; ValueError for an unknown or unsupported one."""
    _import_all()
    if name == "auto":
        first = ("triton",) if pool.device.type == "cuda" else ()
        for candidate in (*first, "cpu-native", "sdpa"):
            if _BACKENDS[candidate].supports(pool):
                return _BACKENDS[candidate](pool, table)
    cls = _BACKENDS.get(name)
    if cls is None:
        raise ValueError(f"attention_backend: unknown backend {name!r}; "
                         f"choose auto or one of {', '.join(sorted(_BACKENDS))}")
    if not cls.supports(pool):
        reason = cls.refusal(pool) or (f"does not run on {pool.device} with {pool.dtype} (or "
                                       "its kernel did not build)")
        raise ValueError(f"attention_backend: {name!r} {reason}; try auto or sdpa")
    return cls(pool, table)


def _import_all() -> None:
    for module in _MODULES:
        importlib.import_module(module)
