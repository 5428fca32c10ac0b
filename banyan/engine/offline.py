"""The offline Python API: `banyan.Engine`, the Scheduler run in-process."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from banyan.args import EngineArgs
from banyan.engine.build import build_engine_core
from banyan.engine.core import SampleGroup
from banyan.model_files import hf_tokenizer
from banyan.outputs import CompletionOutput, RequestOutput, StreamChunk
from banyan.sampling.params import SamplingParams
from banyan.scheduler import RequestUpdate


class Engine:
    """
    >>> with Engine(model="path/to/hf-folder", dtype="float32") as engine:
    ...     outs = engine.generate(["Hello"], SamplingParams(max_new_tokens=8, temperature=0))
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise TypeError(f"unknown Engine argument(s): {', '.join(sorted(unknown))}")
        self.args = EngineArgs(model=model, **kwargs)
        self.core = build_engine_core(self.args)
        self.tokenizer = hf_tokenizer(self.core.tokenizer)  # the full one: users call it
        self._ids = itertools.count()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.core.close()

    # -- requests -------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        return list(self.tokenizer.encode(prompt))

    def add_request(self, prompt: str | None = None, params: SamplingParams | None = None, *,
                    input_ids: Sequence[int] | None = None, request_id: str | None = None,
                    cache_salt: str | None = None) -> SampleGroup:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        ids = self.encode(prompt) if prompt is not None else list(input_ids or [])
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        return self.core.add(rid, ids, params if params is not None else SamplingParams(),
                             namespace=cache_salt)

    def abort(self, request_id: str) -> None:
        """End a request (all its samples) now; its KV returns to the pool at once."""
        for rid in self.core.request_ids():
            if rid == request_id or rid.startswith(f"{request_id}#"):
                self.core.abort(rid)

    def step(self) -> list[RequestUpdate]:
        return self.core.step()

    def flush_cache(self) -> bool:
        """Drop every cached prefix (e.g. after a weight reload); False while requests run."""
        return self.core.flush_cache()

    def explain_prefix(self, prompt: str | None = None, *, input_ids: Sequence[int] | None = None,
                       cache_salt: str | None = None) -> dict[str, object]:
        """How much of a prompt the prefix cache holds now, and why the rest would miss:
        {"matched", "query", "miss_cause": "none" | "evicted" | "unseen" | "in_tier"}, and
        with a KV tier "tier_tokens": how many more tokens a request would load from it."""
        ids = self.encode(prompt) if prompt is not None else list(input_ids or [])
        return self.core.explain_prefix(ids, cache_salt)

    def prefix_cache_stats(self) -> dict[str, int]:
        """Prompt tokens looked up in the prefix cache at admission, and those it served."""
        s = self.core.stats()
        return {"queried_tokens": s.prefix_queried, "hit_tokens": s.prefix_hit,
                "cached_slots": s.kv_cached, "free_slots": s.kv_free}

    # -- batch generation -----------------------------------------------------------------

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        input_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run prompts (text, or token ids through input_ids) to completion, in input order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if (prompts is None) == (input_ids is None):
            raise ValueError("give exactly one of prompts and input_ids")
        count = len(prompts) if prompts is not None else len(input_ids or [])
        params_list = _per_prompt(sampling_params, count)
        outputs: list[RequestOutput] = []
        by_child: dict[str, tuple[RequestOutput, int]] = {}
        added: list[SampleGroup] = []
        try:
            for i in range(count):
                text = prompts[i] if prompts is not None else None
                group = self.add_request(
                    text, params_list[i], input_ids=None if input_ids is None else input_ids[i]
                )
                added.append(group)
                out = RequestOutput(group.rid, text, group.prompt_ids, [
                    CompletionOutput(index=k, logprobs=[] if params_list[i].logprobs is not None
                                     else None) for k in range(len(group.child_rids))])
                outputs.append(out)
                for k, child in enumerate(group.child_rids):
                    by_child[child] = (out, k)
        except BaseException:
            for group in added:
                self.abort(group.rid)
            raise
        pending = len(by_child)
        bar = tqdm(total=pending, desc="generate", unit="req",
                   disable=not use_tqdm or self.args.disable_tqdm)
        try:
            while pending:
                for update in self.core.step():
                    entry = by_child.get(update.rid)
                    if entry is None:
                        continue
                    out, k = entry
                    _apply(out, k, update)
                    if update.finish_reason is not None:
                        pending -= 1
                        bar.update(1)
        except BaseException:
            for group in added:
                self.abort(group.rid)
            raise
        finally:
            bar.close()
        return outputs

    def chat_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """A conversation's prompt ids, exactly tokenizer.apply_chat_template(messages,
        add_generation_prompt=True) (the server's rule, banyan/server/tokens.py)."""
        from banyan.server.tokens import TokenizerSide

        side = TokenizerSide(self.tokenizer, self.core.vocab_size)
        return side.encode_chat(side.chat_prompt(list(messages)))

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, *,
             use_tqdm: bool = False) -> RequestOutput | list[RequestOutput]:
        """Reply to one conversation ([{"role": ..., "content": ...}, ...]) or, batched, to a
        list of them; the reply ends at the template's end of turn (finish_reason "stop")."""
        single = bool(messages) and isinstance(messages[0], dict)
        convs = [messages] if single else list(messages)
        outs = self.generate(input_ids=[self.chat_ids(c) for c in convs],  # type: ignore[arg-type]
                             sampling_params=sampling_params, use_tqdm=use_tqdm)
        return outs[0] if single else outs

    def stream(self, prompt: str | None = None, sampling_params: SamplingParams | None = None, *,
               input_ids: Sequence[int] | None = None) -> Iterator[StreamChunk]:
        """Yield text/token deltas of one request as they are generated (all samples when n > 1,
        each chunk naming its sample index). Other queued work advances meanwhile."""
        group = self.add_request(prompt, sampling_params, input_ids=input_ids)
        index = {child: k for k, child in enumerate(group.child_rids)}
        pending = len(index)
        try:
            while pending:
                for update in self.core.step():
                    if update.rid not in index:
                        continue
                    if update.finish_reason is not None:
                        pending -= 1
                    yield StreamChunk(
                        group.rid, index[update.rid], update.text, update.new_token_ids,
                        None if update.finish_reason is None else update.finish_reason.value,
                        update.logprobs, update.prompt_tokens, update.cached_tokens,
                    )
        finally:
            if pending:  # the consumer stopped early: free the request's KV now
                self.abort(group.rid)


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"sampling_params: {len(params)} given for {count} prompts")
    return params


def _apply(out: RequestOutput, index: int, update: RequestUpdate) -> None:
    sample = out.outputs[index]
    sample.text += update.text
    sample.output_ids.extend(update.new_token_ids)
    if sample.logprobs is not None:
        sample.logprobs.extend(update.logprobs)
    out.cached_tokens = max(out.cached_tokens, update.cached_tokens)
    if update.finish_reason is not None:
        sample.finish_reason = update.finish_reason.value
        sample.error = update.error
