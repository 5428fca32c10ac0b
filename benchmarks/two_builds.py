"""What the build-against-build benchmarks share (bf16_gemm_ab.py, bf16_pairs_forward_ab.py,
layer_stack_ab.py): their arguments (the two kernel libraries, token counts, rounds, the JSON
out), the bf16 GEMM entry point of each library, typed, and the check that both builds give a
case the same bits (or how far apart, where a change of what it computes is measured)."""

from __future__ import annotations

import argparse
import ctypes
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import torch

from banyan.bench.offline import command_line

K = TypeVar("K")


def parse_args(doc: str, tokens: str, rounds: int,
               more: Callable[[argparse.ArgumentParser], None] | None = None,
               ) -> argparse.Namespace:
    """a, b: the libraries (~/.cache/banyan/kernels/*.so of two checkouts); tokens: a list
    ("1,8,13"); rounds; out: a JSON file or None; whatever `more` adds to the parser; command:
    the command line as given, the home directory as ~ (for the JSON)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--tokens", default=tokens)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--out", type=Path, default=None)
    if more is not None:
        more(ap)
    ns = ap.parse_args()
    ns.tokens = [int(t) for t in ns.tokens.split(",")]
    ns.command = command_line()
    return ns


def outputs_apart(label: object, a: torch.Tensor, b: torch.Tensor, may_differ: bool,
                  differences: dict[str, float]) -> bool:
    """The two builds' outputs of one case: the same bits, or (may_differ: a change of what the
    case computes) their largest difference relative to the largest output, printed and kept
    in `differences` under str(label). False where they differ and may not (said on stderr)."""
    if torch.equal(a, b):
        return True
    if not may_differ:
        print(f"{label}: the two builds' outputs differ", file=sys.stderr)
        return False
    a, b = a.float(), b.float()
    differences[str(label)] = rel = ((a - b).abs().max() / a.abs().max()).item()
    print(f"{label}: outputs differ by up to {rel:.3g} of the largest", flush=True)
    return True


def gemm_libraries(a: Path, b: Path, tiles: bool = False) -> dict[str, ctypes.CDLL]:
    """Both libraries, banyan_quant_gemm_bf16 typed in each; tiles: both builds' GEMM on AMX
    tiles (each library keeps its own mode; quantized weights from BF16_GEMM_MIN_TOKENS tokens,
    dense pairs from PAIRS_TILES_FROM, as the engine sets them), SystemExit where refused."""
    libs = {"a": ctypes.CDLL(str(a)), "b": ctypes.CDLL(str(b))}
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for lib in libs.values():
        lib.banyan_quant_gemm_bf16.argtypes = [p, i64, i64, i64, p, p, p, i64, p, p, i64, i64]
        if tiles and _set_gemm_mode(lib, 2) != 2:
            raise SystemExit("--tiles: AMX tiles refused here")
    return libs


def _set_gemm_mode(lib: ctypes.CDLL, mode: int) -> int:
    """A build's bf16 GEMM products in `mode` (gemm_tiles.set_gemm_tiles on that build), its
    tile state asked of Linux first; the mode in effect."""
    from banyan.layers.gemm_tiles import set_gemm_tiles

    lib.banyan_amx_state()  # (asks Linux for the tile state, checks a first tile block)
    # (a build before the dense pairs' own threshold takes two arguments and ignores the third
    # in its register)
    setter = lib.banyan_set_gemm_tiles
    setter.argtypes, setter.restype = [ctypes.c_int64] * 3, ctypes.c_int64
    return set_gemm_tiles(mode, lib)


def native_libraries(a: Path, b: Path) -> dict[str, ctypes.CDLL]:
    """Both libraries set up as banyan.kernels.native.load() sets up its own (every entry point
    typed), for scripts that call the kernels through native's wrappers: point native.load at
    one or the other (`native.load = lambda: libs[name]`) between calls. Both builds must export
    every entry point native.py types (gemm_libraries asks for one only)."""
    return typed_libraries({"a": a, "b": b})


def typed_libraries(paths: Mapping[K, Path]) -> dict[K, ctypes.CDLL]:
    """native_libraries for any number of builds, keyed as `paths` is."""
    from banyan.kernels import native

    build, libs = native._build, {}
    try:
        for name, path in paths.items():
            native._build = lambda compiler, p=path: Path(p)  # type: ignore[assignment]
            native.load.cache_clear()
            lib = native.load()
            if lib is None:
                raise SystemExit(f"could not load {path}")
            libs[name] = lib
    finally:
        native._build = build  # type: ignore[assignment]
        native.load.cache_clear()
    return libs


def stack_entries(stack: object, a: Path, b: Path) -> dict[str, Callable[..., int]]:
    """The layer stack's entry point (`stack._call`, a native_stack.NativeLayerStack's) from each
    library, typed as the stack's own: set `stack._call` to one or the other between steps (every
    kernel a step calls is then that library's), and back to the original after."""
    entry = stack._call  # type: ignore[attr-defined]
    calls = {}
    for name, path in (("a", a), ("b", b)):
        lib = ctypes.CDLL(str(path))
        same_tile_modes(lib)
        fn = getattr(lib, entry.__name__)
        fn.argtypes, fn.restype = entry.argtypes, entry.restype
        calls[name] = fn
    return calls


def same_tile_modes(lib: ctypes.CDLL) -> None:
    """The process's own kernels' tile modes (the row kernel's and the bf16 GEMM's, AMX's where
    the engine chose them) set in another build: each library keeps its own, and a build loaded
    beside them starts on the vector loops (on AMX an A/B of two builds then timed tiles against
    vector loops, with different bits). A build without a setter is left as it is."""
    from banyan.attention.decode_tiles import ASK
    from banyan.kernels import native
    from banyan.layers.gemm_tiles import set_gemm_tiles

    if hasattr(lib, "banyan_set_gemm_tiles"):
        _set_gemm_mode(lib, set_gemm_tiles(ASK))
    if hasattr(lib, "banyan_set_decode_tiles"):
        setter = lib.banyan_set_decode_tiles
        setter.argtypes, setter.restype = [ctypes.c_int64], ctypes.c_int64
        setter(native.set_decode_tiles(ASK))
