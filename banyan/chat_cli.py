"""`banyan chat`: an interactive conversation with the model in the terminal, streamed, the whole
history sent each turn (the prefix cache makes the repeated part free)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from banyan.args import EngineArgs
from banyan.sampling.params import SamplingParams

if TYPE_CHECKING:  # `banyan serve` and the router never load the engine (nor torch) here
    from banyan.engine.offline import Engine


def add_chat_parser(sub: Any, add_args: Callable[[argparse.ArgumentParser], object],
                    engine_args_from: Callable[[argparse.Namespace], EngineArgs],
                    sampling_from: Callable[[argparse.Namespace], SamplingParams]) -> None:
    chat = sub.add_parser("chat", help="chat with the model in the terminal")
    add_args(chat)
    chat.add_argument("--system", default=None, help="system message (default: the template's)")
    # A reply is longer than generate's 32-token default.
    chat.set_defaults(max_new_tokens=512,
                      func=lambda ns: cmd_chat(ns, engine_args_from(ns), sampling_from(ns)))


def open_engine(args: EngineArgs, params: SamplingParams) -> Engine | None:
    """The engine for a command-line run, or None after printing why the arguments are bad."""
    from banyan.engine.offline import Engine

    try:
        params.validate()
        return Engine(**dataclasses.asdict(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def cmd_chat(ns: argparse.Namespace, args: EngineArgs, params: SamplingParams) -> int:
    engine = open_engine(args, params)
    if engine is None:
        return 2
    history: list[dict[str, str]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    print("Type a message; an empty line or Ctrl-D ends the chat.", file=sys.stderr)
    with engine:
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            history.append({"role": "user", "content": line})
            reply = ""
            try:
                for chunk in engine.stream(input_ids=engine.chat_ids(history),
                                           sampling_params=params):
                    reply += chunk.text
                    print(chunk.text, end="", flush=True)
            except ValueError as exc:  # e.g. the history outgrew the context
                print(f"\nerror: {exc}", file=sys.stderr)
                history.pop()
                continue
            print()
            history.append({"role": "assistant", "content": reply})
    return 0
