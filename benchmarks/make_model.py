"""Build the benchmark model: a random-weight Llama with SmolLM2-135M's shape (see PEERS.md).

    python benchmarks/make_model.py OUT_DIR [--dtype bfloat16|float32] [--arch llama|qwen2|...]

The tokenizer is a 49,152-token byte-level BPE trained on the Python standard library's sources
(special tokens <|endoftext|>, <|im_start|>, <|im_end|> as ids 0, 1, 2). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time

from banyan.demo import build_random_model

SMOLLM2_135M_SHAPE = dict(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
    max_position_embeddings=2048,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"],
                        help="the architecture in SmolLM2-135M's shape (qwen2: biased q/k/v)")
    ns = parser.parse_args()
    t0 = time.time()
    build_random_model(ns.out, ns.arch, tokenizer_vocab=49152, tokenizer_corpus_bytes=20_000_000,
                       dtype=ns.dtype, seed=0, **SMOLLM2_135M_SHAPE)
    print(f"built {ns.out} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
