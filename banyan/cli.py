"""`banyan serve | generate | route | bench`: the command line, generated from the argument
dataclasses."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from banyan.args import EngineArgs, add_dataclass_args, engine_args_from
from banyan.bench.cli import add_bench_parser
from banyan.chat_cli import add_chat_parser, open_engine
from banyan.router.cli import add_dp_args, add_route_parser, run_serve_dp
from banyan.sampling.params import SamplingParams
from banyan.server.args import ServerArgs


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-new-tokens", type=int, default=32)
    group.add_argument("--min-new-tokens", type=int, default=0)
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--sampling-seed", dest="sample_seed", type=int, default=None,
                       help="per-request seed: the same seed gives the same text")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")
    group.add_argument("--n", type=int, default=1, help="samples per prompt")


def _sampling_from(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=ns.max_new_tokens, min_new_tokens=ns.min_new_tokens,
        temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty, frequency_penalty=ns.frequency_penalty,
        presence_penalty=ns.presence_penalty, seed=ns.sample_seed, stop=ns.stop,
        ignore_eos=ns.ignore_eos, n=ns.n,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="banyan", description="Banyan LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_dataclass_args(serve.add_argument_group("engine"), EngineArgs)
    add_dataclass_args(serve.add_argument_group("server"), ServerArgs)
    serve.set_defaults(func=cmd_serve)

    add_dp_args(serve)
    add_route_parser(sub)

    gen = sub.add_parser("generate", help="generate text for one or more prompts, offline")
    add_dataclass_args(gen.add_argument_group("engine"), EngineArgs)
    gen.add_argument("--prompt", action="append", required=True, help="prompt (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per output")
    gen.add_argument("--chat", action="store_true",
                     help="each prompt is a user message, rendered by the model's chat template")
    _add_sampling_args(gen)

    add_bench_parser(sub)
    add_chat_parser(sub, lambda p: (add_dataclass_args(p.add_argument_group("engine"), EngineArgs),
                                    _add_sampling_args(p)), engine_args_from, _sampling_from)
    return parser


def cmd_generate(ns: argparse.Namespace) -> int:
    params = _sampling_from(ns)
    engine = open_engine(engine_args_from(ns), params)
    if engine is None:
        return 2
    with engine:
        try:
            if ns.chat:
                outputs = engine.chat([[{"role": "user", "content": p}] for p in ns.prompt],
                                      params)
                for out, text in zip(outputs, ns.prompt, strict=True):
                    out.prompt = text  # the user's words, not the rendered template
            else:
                outputs = engine.generate(ns.prompt, params, use_tqdm=False)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    for out in outputs:
        for sample in out.outputs:
            if ns.json:
                print(json.dumps({"prompt": out.prompt, "index": sample.index, "text": sample.text,
                                  "output_ids": sample.output_ids,
                                  "finish_reason": sample.finish_reason,
                                  "prompt_tokens": out.prompt_tokens}))
            else:
                print(f"{out.prompt}\n{sample.text}" if ns.chat else f"{out.prompt}{sample.text}")
                print(f"  [{sample.completion_tokens} tokens, "
                      f"finish_reason={sample.finish_reason}]")
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from banyan.server.launch import run_server  # FastAPI and uvicorn: only when serving

    try:
        engine_args = engine_args_from(ns)
        server_args = ServerArgs(**{name: getattr(ns, name) for name in ServerArgs.field_names()})
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if ns.dp != 1 or ns.pd is not None:
        return run_serve_dp(ns, engine_args, server_args)
    return run_server(engine_args, server_args)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    if ns.command == "generate":
        return cmd_generate(ns)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
