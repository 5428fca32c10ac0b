"""Structured output: constrain what a request may generate to a grammar (JSON schema, regex,
choice, EBNF), and tool calling built on it.

The rest of the engine calls only this package's small surface:
- `StructuredSpec` (spec.py): what a request asks for; carried in SamplingParams.
- `GrammarBackend` (grammar.py): compiles specs off the step loop (cache, timeout) and makes
  one `GrammarState` (a matcher) per request sample.
- `TokenMasks` (masks.py): the runner fills one bitmask row per logit row from the states
  (several rows per request with speculative proposals), the sampler applies it, and the
  runner advances each state by the tokens it accepted, in step order.
"""

from banyan.structured.spec import StructuredSpec

__all__ = ["StructuredSpec"]
