"""`banyan bench quality`: perplexity of a fixed text computed with Banyan's own forward (the
paged KV pool, the text fed in prefill chunks as a long prompt is), beside transformers' on the
same text and model. In float32 the two agree to well within 0.1%; a larger gap means Banyan
computes something else than the reference (a bad conversion, a wrong kernel)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from banyan.args import ACTIVATION_QUANT_CHOICES, KV_CACHE_DTYPES

if TYPE_CHECKING:  # torch loads when a score is computed, not when the CLI is built
    import torch

    from banyan.runner.model_runner import ModelRunner

# A fixed English text (written for Banyan, about 600 tokens for a GPT-2-style BPE): the default
# text of `bench quality`, and the source of the real-model tests' prompts.
REFERENCE_TEXT = """\
The old lighthouse stood at the end of a narrow spit of land, where the river met the sea. For \
more than a century its keepers had climbed the spiral stairs every evening to light the lamp, \
and every morning they had climbed them again to put it out. The last keeper, a quiet woman \
named Ada, kept a logbook in which she wrote down the weather, the ships that passed, and the \
birds that rested on the railing during storms.

In the spring the fishing boats left the harbour before dawn. Their engines could be heard long \
before their lights appeared, and by the time the sun rose they were small grey shapes on the \
horizon. The boats came back in the afternoon, followed by gulls, and the market by the quay \
filled with people buying cod, mackerel and crabs. Children ran between the stalls, and the \
smell of salt and diesel hung over the square until evening.

Ada liked to say that a lighthouse does not save ships; it only tells them where the rocks are. \
The captains still had to read their charts, watch the tide, and decide when to turn. She had \
seen good sailors make bad choices in calm weather and careful ones come home safely through \
gales. What mattered, she thought, was paying attention: to the wind, to the colour of the \
water, to the small changes that come before a big one.

When the lamp was finally automated, the town held a small ceremony. The mayor gave a speech, \
a brass band played two songs, and Ada handed over the keys. She moved into a cottage on the \
hill, from which she could still see the light turning every night. She continued to keep her \
logbook, out of habit, although nobody asked her to. Years later, a historian found the books \
in the town library and used them to reconstruct a hundred years of weather on that coast.

The records showed that the winters had become milder and the storms more frequent. They also \
showed how the harbour had changed: fewer fishing boats, more sailing yachts, and in summer a \
ferry that carried tourists to the islands. The historian wrote that the logbooks were \
valuable not because any single entry was remarkable, but because someone had written the \
same kinds of observations, carefully and patiently, every day for decades.

Today the lighthouse is a museum. Visitors climb the stairs, look at the great glass lens, and \
read copies of Ada's pages on the walls. On clear evenings the light still turns above them, \
sweeping across the water in long, steady circles, as it has done for as long as anyone in the \
town can remember.
"""


@dataclass(slots=True)
class Perplexity:
    tokens: int  # tokens predicted (the text's length minus one)
    nll: float  # mean negative log-likelihood per predicted token, nats

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


def _nll_sum(logits: torch.Tensor, targets: list[int]) -> float:
    import torch

    target = torch.tensor(targets, dtype=torch.long, device=logits.device)
    loss = torch.nn.functional.cross_entropy(logits.double(), target, reduction="sum")
    return float(loss)


def banyan_perplexity(runner: ModelRunner, ids: list[int], chunk: int = 256) -> Perplexity:
    """Feed `ids` through Banyan's model in chunks of `chunk` tokens (each attending to the KV of
    the previous ones, as a chunked prefill does) and score every next token."""
    import torch

    from banyan.batch import ForwardBatch
    from banyan.mem.allocator import SlotAllocator

    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    slots = SlotAllocator(runner.num_slots).alloc(len(ids))
    if slots is None:
        raise ValueError(f"the KV cache holds {runner.num_slots} slots, the text {len(ids)} tokens")
    total = 0.0
    for start in range(0, len(ids) - 1, chunk):
        n = min(chunk, len(ids) - start)
        batch = ForwardBatch(rows=[0], prefix_lens=[start], extend_lens=[n],
                             input_ids=ids[start:start + n], out_slots=slots[start:start + n])
        with torch.inference_mode():
            inputs = runner.prepare(batch)
            hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attn_meta)
            logits = runner.model.compute_logits(hidden)
        targets = ids[start + 1:start + n + 1]
        total += _nll_sum(logits[:len(targets)], targets)
    return Perplexity(len(ids) - 1, total / (len(ids) - 1))


def hf_perplexity(model: Any, ids: list[int]) -> Perplexity:
    """The same score from a transformers causal LM, in one forward."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0]
    return Perplexity(len(ids) - 1, _nll_sum(logits[:-1], ids[1:]) / (len(ids) - 1))


def add_quality_parser(modes: Any) -> None:
    q = modes.add_parser("quality", help="perplexity of a text with Banyan's forward "
                                         "(and transformers' with --reference)")
    q.add_argument("--model", default=None, help="as for serve (default: SmolLM2-135M-Instruct)")
    q.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    q.add_argument("--text-file", type=Path, default=None,
                   help="text to score (default: a fixed ~600-token English text)")
    q.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "gguf"],
                   help="weight format of the linears (as for serve)")
    q.add_argument("--activation-quant", default="none", choices=list(ACTIVATION_QUANT_CHOICES),
                   help="activations of the quantized linears (as for serve)")
    q.add_argument("--kv-cache-dtype", default="auto",
                   choices=list(KV_CACHE_DTYPES),
                   help="storage of the KV cache (as for serve)")
    q.add_argument("--chunk", type=int, default=256, help="prefill chunk, tokens")
    q.add_argument("--reference", action="store_true",
                   help="also score with transformers on the same (converted) model, float32")
    q.set_defaults(func=run_quality)


def run_quality(ns: argparse.Namespace) -> int:
    from banyan.model_files import gguf_source, load_tokenizer, resolve_model_dir
    from banyan.runner.model_runner import ModelRunner

    folder = resolve_model_dir(ns.model)
    text = ns.text_file.read_text() if ns.text_file else REFERENCE_TEXT
    ids = list(load_tokenizer(folder).encode(text))
    runner = ModelRunner(folder, dtype=ns.dtype, num_slots=len(ids) + 1, max_rows=1,
                         max_context=len(ids), quantization=ns.quantization,
                         kv_cache_dtype=ns.kv_cache_dtype, activation_quant=ns.activation_quant,
                         gguf_file=gguf_source(ns.model) if ns.quantization == "gguf" else None)
    ours = banyan_perplexity(runner, ids, ns.chunk)
    report: dict[str, Any] = {"model": str(folder), "dtype": str(runner.dtype),
                              "quantization": ns.quantization,
                              "activation_quant": ns.activation_quant,
                              "kv_cache_dtype": ns.kv_cache_dtype, **asdict(ours),
                              "ppl": ours.ppl}
    if ns.reference:
        import torch
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        ref = hf_perplexity(hf, ids)
        report |= {"reference_ppl": ref.ppl, "relative_diff": ours.ppl / ref.ppl - 1}
    print(json.dumps(report, indent=2))
    return 0
