"""Text workloads for speculative decoding: input-grounded generation (the answer copies spans
of the prompt: repeat, rewrite or edit a given passage or code), where prompt lookup shines, and
free chat (nothing to copy), where it must cost nothing.

Prompts are chat messages rendered with the model's chat template, so the model answers as it
would a user; the passages are fixed (the bench-quality text and a short Python file), so every
run and every engine sees the same prompts.
"""

from __future__ import annotations

from typing import Any

from banyan.bench.quality import REFERENCE_TEXT
from banyan.bench.workloads import BenchRequest, Workload

CODE = '''\
def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out


def normalize(values):
    low, high = min(values), max(values)
    if high == low:
        return [0.0 for _ in values]
    return [(v - low) / (high - low) for v in values]
'''

GROUNDED_TASKS = (
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Rewrite the following text in the present tense, changing nothing else:\n\n{text}",
    "Copy the following text and put every sentence on its own line:\n\n{text}",
    "Here is a Python file:\n\n{code}\nRewrite it with type hints added, keeping the code as "
    "it is otherwise.",
    "Here is a Python file:\n\n{code}\nRename `values` to `data` everywhere and show the whole "
    "file.",
)

CHAT_QUESTIONS = (
    "Write a short poem about autumn leaves.",
    "What are three good habits for staying healthy?",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "What should I pack for a weekend hiking trip?",
    "Tell me a short story about a robot who learns to paint.",
    "How do I make my mornings more productive?",
    "Describe the city of your dreams in a few sentences.",
)


def _render(tokenizer: Any, message: str) -> list[int]:
    """The prompt ids the server would make of this one user message."""
    from banyan.server.tokens import TokenizerSide

    side = TokenizerSide(tokenizer, len(tokenizer))
    return side.encode_chat(side.chat_prompt([{"role": "user", "content": message}]))


def grounded_workload(tokenizer: Any, num_requests: int, output_len: int) -> Workload:
    paragraphs = [p.strip() for p in REFERENCE_TEXT.split("\n\n") if p.strip()]
    reqs = []
    for i in range(num_requests):
        task = GROUNDED_TASKS[i % len(GROUNDED_TASKS)]
        message = task.format(text=paragraphs[i % len(paragraphs)], code=CODE)
        reqs.append(BenchRequest(_render(tokenizer, message), output_len, group=i))
    # the answer is the task: a repeated passage ends at EOS, and what a model writes past it
    # (an invented next turn) is neither grounded nor anything a user would be sent
    return Workload("grounded", reqs, 0, {"num_requests": num_requests, "output_len": output_len,
                                          "stop_at_eos": True}, stop_at_eos=True)


def chat_workload(tokenizer: Any, num_requests: int, output_len: int) -> Workload:
    reqs = [BenchRequest(_render(tokenizer, CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]), output_len,
                         group=i) for i in range(num_requests)]
    return Workload("chat", reqs, 0, {"num_requests": num_requests, "output_len": output_len})
