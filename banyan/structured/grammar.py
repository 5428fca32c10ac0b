"""Grammar compilation and per-request matchers, on xgrammar (docs/structured_output.md says
why xgrammar rather than llguidance).

Compilation runs on a small thread pool, never on the step loop: `GrammarBackend.submit` returns
a Future, shared by every request asking for the same spec (and xgrammar keeps its own cache of
compiled grammars), so a request waits for its grammar while the others keep stepping.
Whitespace inside JSON is fixed (no free spaces or newlines): a model, random weights
included, cannot wander in whitespace forever, so generation terminates.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from banyan.structured.spec import StructuredSpec

if TYPE_CHECKING:  # the API server checks grammars without loading torch
    import torch

# Proposed tokens a matcher can take back (speculative decoding checks up to this many).
MAX_ROLLBACK = 16
_CACHE_ENTRIES = 256
_LIBRARY_PREFIX = re.compile(r"^\[[0-9:]+\] \S+: ")


def _xgr() -> Any:
    import xgrammar

    return xgrammar


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar accepting exactly one of the strings (JSON string escapes are valid
    xgrammar EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar 0.2.8 writes a string with minLength/maxLength as characters of the first class,
# which lets raw control characters through (invalid JSON); and both its string classes let
# UTF-16 surrogates through, encoded in UTF-8 (invalid UTF-8, decoded as U+FFFD). Each is
# replaced by the class of characters JSON allows unescaped.
_JSON_CHAR = r'[^\"\\\0-\x1f\uD800-\uDFFF]'
_LOOSE_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')


def json_schema_ebnf(schema: str) -> str:
    """The EBNF grammar of a JSON schema: no free whitespace (so generation terminates), and
    no raw control characters inside length-limited strings."""
    grammar = _xgr().Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    text = str(grammar)
    for loose in _LOOSE_CHARS:
        text = text.replace(loose, _JSON_CHAR)
    return text


def check_compiles(spec: StructuredSpec, field: str) -> None:
    """ValueError (naming `field`) when the spec is not a grammar xgrammar accepts; cheap (no
    tokenizer), so the API server calls it before a request is queued."""
    xgr = _xgr()
    try:
        if spec.kind == "json":
            xgr.Grammar.from_json_schema(spec.value, any_whitespace=False, strict_mode=True)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.value)
        elif spec.kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec.value)))
        elif spec.kind == "grammar":
            xgr.Grammar.from_ebnf(spec.value)
        elif spec.kind != "json_object":
            raise ValueError(f"unknown structured output kind {spec.kind!r}")
    except (RuntimeError, ValueError, TypeError) as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        # drop the library's "[hh:mm:ss] /path/file.cc:NN: " prefix
        raise ValueError(f"{field}: {_LIBRARY_PREFIX.sub('', first)}") from None


class GrammarState:
    """One request sample's matcher. Advanced only by tokens the sampler produced for it, in
    step order (on the runner's worker when overlapping), so a retracted request that is
    prefilled again never replays tokens into it."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self.accepted = 0  # tokens advanced so far
        # Tokens accepted when the grammar ended (its stop token taken, or a token it refused):
        # the request finishes with the token whose count this is.
        self.ended_at: int | None = None

    def fill(self, bitmask: torch.Tensor, index: int, proposed: list[int]) -> None:
        """Rows index .. index + len(proposed) of `bitmask`: the tokens allowed now, then
        after each proposed token (proposals are taken back afterwards)."""
        m = self._matcher
        if self.ended_at is not None:  # ended; this row's token is dropped by the scheduler
            bitmask[index : index + len(proposed) + 1].fill_(-1)
            return
        m.fill_next_token_bitmask(bitmask, index)
        taken = 0
        for j, token in enumerate(proposed, start=1):
            if m.is_terminated() or not m.accept_token(token):
                # the proposal is invalid: the sampled token differs and what follows is unused
                bitmask[index + j : index + len(proposed) + 1].fill_(-1)
                break
            taken += 1
            m.fill_next_token_bitmask(bitmask, index + j)
        if taken:
            m.rollback(taken)

    def advance(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            if self.ended_at is not None:
                return
            self.accepted += 1
            if not self._matcher.accept_token(token) or self._matcher.is_terminated():
                self.ended_at = self.accepted

    def ends_with(self, num_output: int) -> bool:
        """Whether the grammar ended with the request's num_output-th token."""
        return self.ended_at == num_output


class GrammarBackend:
    """Compiles specs for one tokenizer and vocabulary (the model's logit width)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 threads: int = 1) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="banyan-grammar")
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._futures: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()

    def submit(self, spec: StructuredSpec) -> Future[Any]:
        """The compiled grammar, when ready (shared by identical specs)."""
        with self._lock:
            future = self._futures.get(spec.key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._futures.move_to_end(spec.key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._futures[spec.key] = future
            while len(self._futures) > _CACHE_ENTRIES:
                self._futures.popitem(last=False)
            return future

    def new_state(self, compiled: Any) -> GrammarState:
        xgr = _xgr()
        return GrammarState(xgr.GrammarMatcher(compiled, max_rollback_tokens=MAX_ROLLBACK))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredSpec) -> Any:
        compiler = self._get_compiler()
        if spec.kind in ("json", "json_object"):
            schema = spec.value if spec.kind == "json" else '{"type": "object"}'
            return compiler.compile_grammar(json_schema_ebnf(schema))
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            return compiler.compile_grammar(choice_ebnf(json.loads(spec.value)))
        if spec.kind == "grammar":
            return compiler.compile_grammar(spec.value)
        raise ValueError(f"unknown structured output kind {spec.kind!r}")

    def _get_compiler(self) -> Any:
        # Built on the first compile (the vocabulary scan takes up to a second), on the pool.
        if self._compiler is None:
            from banyan.model_files import hf_tokenizer

            xgr = _xgr()
            info = xgr.TokenizerInfo.from_huggingface(
                hf_tokenizer(self.tokenizer), vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler
