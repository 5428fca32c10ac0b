"""Incremental detokenization and stop strings, on the project's byte-level BPE (Llama 3 / Qwen
style) and on a SentencePiece-style tokenizer (Metaspace with byte fallback, Llama 2 / Mistral
style), whose decoder strips the leading space of a decode."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from banyan.demo import training_corpus
from banyan.engine.byte_detok import ByteDetokenizer, ByteTextStream, TokenBytes
from banyan.engine.detok import IncrementalDetokenizer, StopStringMatcher, TextAccumulator
from banyan.sampling.params import SamplingParams

TEXTS = [
    "Once upon a time, there was a café in Zürich.",
    "你好，世界！今天天气很好。東京 日本語のテキスト",
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧 walk by  with  spaces\tand\n\nnewlines",
    "Ελληνικά, русский текст, naïve façade — “quotes” ≤ ≥ → λ",
    "def f(x):\n    return x ** 2  # 🐍\n",
]


@pytest.fixture(scope="module")
def bytelevel(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="module")
def metaspace() -> Any:
    return train_metaspace_tokenizer()


def train_metaspace_tokenizer() -> Any:
    """BPE over Metaspace pieces with <0xNN> byte-fallback tokens and Llama 2's decoder chain."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=120, show_progress=False)
    tok.train_from_iterator(training_corpus(100_000) + TEXTS[:2], trainer)
    spec = json.loads(tok.to_str())
    trained = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    # Byte tokens right after the specials, as in Llama 2's vocabulary.
    vocab = trained[:3] + [f"<0x{b:02X}>" for b in range(256)] + trained[3:]
    spec["model"].update(vocab={t: i for i, t in enumerate(vocab)}, byte_fallback=True,
                         fuse_unk=True)
    for added in spec["added_tokens"]:
        added["id"] = vocab.index(added["content"])
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(params=["bytelevel", "metaspace"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


def stream(tokenizer: Any, prompt: list[int], output: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    return [detok.push(t) for t in output] + [detok.finish()]


def continuation(tokenizer: Any, prompt: list[int], output: list[int],
                 skip: bool = True) -> str | None:
    """What the output adds to the prompt's text, decoded in one go; None when the prompt ends
    inside a character that the output completes (no text is "added" then: the prompt's own
    text changes)."""
    full = tokenizer.decode(prompt + output, skip_special_tokens=skip)
    head = tokenizer.decode(prompt, skip_special_tokens=skip)
    return full[len(head):] if full.startswith(head) else None


# --- incremental detokenizer ----------------------------------------------------------------------

def test_multibyte_text_streams_exactly(tokenizer: Any) -> None:
    held_back = 0
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for cut in range(len(ids)):  # every prompt/output split, prompt empty included
            prompt, output = ids[:cut], ids[cut:]
            want = continuation(tokenizer, prompt, output)
            if want is None:
                continue
            deltas = stream(tokenizer, prompt, output)
            assert "".join(deltas) == want
            assert not any("\ufffd" in d for d in deltas)
            assert deltas[-1] == ""  # valid text leaves nothing to flush
            held_back += deltas.count("")
        assert "".join(stream(tokenizer, [], ids)) == tokenizer.decode(ids) == text
    assert held_back > 0  # characters really were split across tokens


def test_long_outputs_stream_exactly(tokenizer: Any) -> None:
    """Outputs of hundreds of tokens stream exactly (one-shot decode of the continuation)."""
    text = " ".join(TEXTS) * 3
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 100
    for cut in (0, 3, 17):
        prompt, output = ids[:cut], ids[cut:]
        want = continuation(tokenizer, prompt, output)
        assert want is not None and "".join(stream(tokenizer, prompt, output)) == want


def test_leading_space_of_the_first_output_token_is_kept(tokenizer: Any) -> None:
    prompt = tokenizer.encode("Once upon a", add_special_tokens=False)
    output = tokenizer.encode("Once upon a time", add_special_tokens=False)[len(prompt):]
    assert "".join(stream(tokenizer, prompt, output)) == " time"


def byte_stream(tokenizer: Any, prompt: list[int], output: list[int], skip: bool = True
                ) -> list[str]:
    table = TokenBytes.of(tokenizer)
    assert table is not None
    detok = ByteDetokenizer(table, prompt, skip_special_tokens=skip)
    return [detok.push(t) for t in output] + [detok.finish()]


def byte_text_stream(tokenizer: Any, prompt: list[int], output: list[int], skip: bool = True
                     ) -> list[str]:
    table = TokenBytes.of(tokenizer)
    assert table is not None
    text = ByteTextStream(table, prompt, skip_special_tokens=skip)
    deltas = [text.push_text(t)[0] for t in output] + [text.finish()]
    assert not text.stopped
    return deltas


@pytest.mark.parametrize("streamer", [stream, byte_stream, byte_text_stream],
                         ids=["window", "byte-table", "byte-text-stream"])
def test_random_ids_on_byte_level_match_one_shot_decode(bytelevel: Any, streamer: Any) -> None:
    # Random byte-level tokens are mostly invalid UTF-8: the flush must still give the exact text.
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        prompt = [rng.randrange(len(bytelevel)) for _ in range(rng.randrange(6))]
        output = [rng.randrange(len(bytelevel)) for _ in range(rng.randrange(1, 80))]
        for skip in (True, False):
            deltas = streamer(bytelevel, prompt, output, skip)
            want = continuation(bytelevel, prompt, output, skip)
            if want is not None:
                assert "".join(deltas) == want
                checked += 1
    assert checked > 300


def test_random_ids_on_byte_fallback_never_fail(metaspace: Any) -> None:
    rng = random.Random(1)
    for _ in range(200):
        output = [rng.randrange(len(metaspace)) for _ in range(20)]
        deltas = stream(metaspace, [], output)
        assert len("".join(deltas)) >= len(output) // 4  # text, not lost


def test_special_tokens_skipped_or_kept(bytelevel: Any) -> None:
    im_end = bytelevel.convert_tokens_to_ids("<|im_end|>")
    output = bytelevel.encode("hé", add_special_tokens=False) + [im_end]
    output += bytelevel.encode(" 😀 ok", add_special_tokens=False)
    assert "".join(stream(bytelevel, [], output, skip=True)) == "hé 😀 ok"
    assert "".join(stream(bytelevel, [], output, skip=False)) == "hé<|im_end|> 😀 ok"


def test_incomplete_character_is_flushed_at_the_end(bytelevel: Any) -> None:
    ids = bytelevel.encode("ab😀", add_special_tokens=False)
    assert len(bytelevel.decode(ids[-1:])) == 1  # the emoji's last byte has a token of its own
    deltas = stream(bytelevel, [], ids[:-1])
    assert deltas[-1].endswith("\ufffd") and "".join(deltas) == bytelevel.decode(ids[:-1])


# --- byte-level table (engine/byte_detok.py) ------------------------------------------------------

def test_the_byte_table_is_made_for_byte_level_decoders_only(bytelevel: Any,
                                                               metaspace: Any) -> None:
    assert TokenBytes.of(bytelevel) is not None
    assert TokenBytes.of(metaspace) is None  # Metaspace + byte fallback: the window decoder


def test_byte_table_streams_what_the_window_decoder_streams(bytelevel: Any) -> None:
    """Valid text: the same delta at every token (a character goes out with its last byte).
    (Random ids: test_random_ids_on_byte_level_match_one_shot_decode, for both.)"""
    for text in TEXTS:
        ids = bytelevel.encode(text, add_special_tokens=False)
        for cut in range(len(ids)):
            prompt, output = ids[:cut], ids[cut:]
            if continuation(bytelevel, prompt, output) is not None:
                assert byte_stream(bytelevel, prompt, output) == stream(bytelevel, prompt, output)


def test_byte_table_when_the_prompt_ends_inside_a_character(bytelevel: Any) -> None:
    """The prompt's text already shows a U+FFFD for its unfinished character: an output that
    breaks the character does not emit it again; one that finishes it emits the character."""
    ids = bytelevel.encode("ab😀", add_special_tokens=False)
    emoji = ids[2:]
    assert len(emoji) > 1  # the emoji is cut across tokens
    prompt = ids[:3]  # ends inside the emoji
    tail = bytelevel.encode("cd", add_special_tokens=False)
    assert continuation(bytelevel, prompt, tail) == "cd"
    assert "".join(byte_stream(bytelevel, prompt, tail)) == "cd"
    assert "".join(byte_stream(bytelevel, prompt, [])) == ""
    assert "".join(byte_stream(bytelevel, prompt, emoji[1:] + tail)) == "😀cd"


def test_push_many_equals_push_on_each_stream(bytelevel: Any) -> None:
    """The decode lane's step of many byte-level streams at once against one push per
    stream: the same text at every step, through unfinished characters, prompts ending inside
    one, special tokens skipped or kept, and ids past the tokenizer's table (a padded vocab)."""
    table = TokenBytes.of(bytelevel)
    assert table is not None
    rng = random.Random(2)
    vocab = len(bytelevel) + 3  # ids past the table
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 6))] for _ in range(40)]
    skips = [i % 3 != 0 for i in range(40)]
    batched = [ByteTextStream(table, p, skip_special_tokens=k) for p, k in zip(prompts, skips)]
    single = [ByteTextStream(table, p, skip_special_tokens=k) for p, k in zip(prompts, skips)]
    for _ in range(60):
        tokens = [rng.randrange(vocab) for _ in batched]
        assert ByteTextStream.push_many(batched, tokens) == [
            s.push_text(t)[0] for s, t in zip(single, tokens)]
    assert [s.finish() for s in batched] == [s.finish() for s in single]


def test_text_accumulator_with_the_byte_table(bytelevel: Any) -> None:
    table = TokenBytes.of(bytelevel)
    ids = bytelevel.encode(" ".join(TEXTS), add_special_tokens=False)
    for stop in ([], ["café", "😀"], ["\n\n"]):
        params = SamplingParams(stop=stop)
        deltas = []
        for token_bytes in (None, table):
            acc = TextAccumulator.from_params(bytelevel, ids[:4], params, token_bytes)
            deltas.append([acc.push(t) for t in ids[4:]] + [acc.finish()])
        assert deltas[0] == deltas[1]
        # the stream a request gets: without stop strings the one-object ByteTextStream
        text = TextAccumulator.for_request(bytelevel, ids[:4], params, table)
        assert isinstance(text, ByteTextStream) == (not stop)
        pushed = [text.push_text(t) for t in ids[4:]]
        assert [(d.text, d.stopped) for d in deltas[0][:-1]] == pushed
        assert text.finish() == deltas[0][-1]


# --- stop strings ---------------------------------------------------------------------------------

def test_stop_string_matcher() -> None:
    matcher = StopStringMatcher(["END", "\n\n", "ab"])
    assert matcher.find("xx END yy", new_chars=3) is None  # completed before the new characters
    match = matcher.find("xx END yy", new_chars=6)
    assert match is not None and (match.start, match.stop) == (3, "END")
    match = matcher.find("q\n\nabEND", new_chars=8)
    assert match is not None and (match.start, match.stop) == (1, "\n\n")  # the earliest wins
    assert matcher.holdback("text E") == 1
    assert matcher.holdback("text EN") == 2
    assert matcher.holdback("text\n") == 1
    assert matcher.holdback("text a") == 1
    assert matcher.holdback("text") == 0
    assert not StopStringMatcher([]) and StopStringMatcher([]).holdback("abc") == 0


def accumulate(tokenizer: Any, output: list[int], stop: list[str],
               include_stop: bool = False) -> tuple[list[str], bool, Any]:
    acc = TextAccumulator(tokenizer, [], stop=stop, include_stop=include_stop)
    emitted: list[str] = []
    for token in output:
        delta = acc.push(token)
        emitted.append(delta.text)
        if delta.stopped:
            return emitted, True, acc
    emitted.append(acc.finish())
    return emitted, False, acc


def test_stop_string_spanning_two_tokens_is_trimmed(tokenizer: Any) -> None:
    text = "Once upon a time, 你好 the end"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode(ids[:i + 1]) for i in range(len(ids))]
    stop = "on a ti"
    assert not any(stop in tokenizer.decode([t]) for t in ids)  # no single token holds it
    emitted, stopped, acc = accumulate(tokenizer, ids, [stop, "zzz"])
    assert stopped and "".join(emitted) == acc.text == "Once up"
    # Nothing of the stop string leaked out before it was complete.
    first_stop_char = next(i for i, p in enumerate(pieces) if len(p) > len("Once up"))
    assert "".join(emitted[:first_stop_char + 1]) == "Once up"
    assert acc.push(ids[-1]).stopped and acc.finish() == ""


def test_included_stop_string_ends_the_text(tokenizer: Any) -> None:
    ids = tokenizer.encode("Once upon a time, 你好 the end", add_special_tokens=False)
    emitted, stopped, acc = accumulate(tokenizer, ids, ["on a ti", "你"], include_stop=True)
    assert stopped and "".join(emitted) == acc.text == "Once upon a ti"
    assert acc.finish() == ""


def test_stop_string_at_the_start_gives_empty_text(tokenizer: Any) -> None:
    ids = tokenizer.encode("你好 world", add_special_tokens=False)
    emitted, stopped, acc = accumulate(tokenizer, ids, ["你"])
    assert stopped and acc.text == "" and "".join(emitted) == ""


def test_held_back_text_is_released_when_no_stop_matches(tokenizer: Any) -> None:
    ids = tokenizer.encode("the quick brown fox END", add_special_tokens=False)
    emitted, stopped, acc = accumulate(tokenizer, ids, ["ENDING", "fox jumps"])
    assert not stopped
    assert "".join(emitted[:-1]) == "the quick brown fox "  # "END" could still begin "ENDING"
    assert emitted[-1] == "END" and acc.text == "the quick brown fox END"


def test_accumulator_matches_a_naive_reference(tokenizer: Any) -> None:
    """Random texts and stop strings: the output is the text up to the earliest stop string found
    when it first completes, and everything emitted is exactly that text."""
    rng = random.Random(2)
    for _ in range(150):
        text = rng.choice(TEXTS) + " " + rng.choice(TEXTS)
        ids = tokenizer.encode(text, add_special_tokens=False)
        stops = []
        for _ in range(rng.randrange(1, 4)):
            at, length = rng.randrange(len(text)), rng.randrange(1, 6)
            stops.append(text[at:at + length] if rng.random() < 0.7 else "§" * length)
        deltas = stream(tokenizer, [], ids)
        seen, want = "", None
        for delta in deltas:
            seen += delta
            found = [seen.find(s) for s in stops if s in seen]
            if found:
                want = seen[:min(found)]
                break
        emitted, stopped, acc = accumulate(tokenizer, ids, stops)
        assert stopped == (want is not None)
        assert "".join(emitted) == acc.text == (want if stopped else text)


def test_from_params_uses_stop_and_skip_special_tokens(bytelevel: Any) -> None:
    eot = bytelevel.convert_tokens_to_ids("<|endoftext|>")
    params = SamplingParams(stop=["lo w"], skip_special_tokens=False)
    acc = TextAccumulator.from_params(bytelevel, [eot], params)
    ids = [eot] + bytelevel.encode("hello world", add_special_tokens=False)
    texts = [acc.push(t).text for t in ids]
    assert acc.stopped and "".join(texts) == acc.text == "<|endoftext|>hel"


def test_stop_strings_count_only_from_min_new_tokens(bytelevel: Any) -> None:
    ids = bytelevel.encode("ab ab ab", add_special_tokens=False)
    words = [len(bytelevel.decode(ids[:i + 1])) for i in range(len(ids))]  # text length per token
    second = next(i for i, n in enumerate(words) if n >= len("ab ab")) + 1  # tokens to 2nd "ab"
    params = SamplingParams(stop=["ab"], min_new_tokens=second, max_new_tokens=50)
    acc = TextAccumulator.from_params(bytelevel, [], params)
    texts = []
    for token in ids:
        delta = acc.push(token)
        texts.append(delta.text)
        if delta.stopped:
            break
    # The first "ab" came before min_new_tokens and streamed; the second one stopped.
    assert delta.stopped and "".join(texts) == acc.text == "ab "


# --- invalid bytes --------------------------------------------------------------------------------

def byte_token(tokenizer: Any, byte: int) -> int:
    """The byte-level token of one raw byte (GPT-2's byte-to-unicode map: printable Latin-1
    bytes stand for themselves, the others for chr(256 + their rank))."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    char = chr(byte) if byte in printable else chr(256 + others.index(byte))
    token = tokenizer.convert_tokens_to_ids(char)
    return token


def test_invalid_bytes_are_held_back_at_most_three_tokens(bytelevel: Any) -> None:
    """32 continuation bytes with no lead byte never form a character: they stream as U+FFFD
    every 4 tokens rather than all at the end (the issue-15 request streamed nothing)."""
    invalid = byte_token(bytelevel, 0x80)
    deltas = stream(bytelevel, [], [invalid] * 32)
    pushed = deltas[:-1]  # the last entry is finish()
    assert pushed[:3] == ["", "", ""] and pushed[3:] == ["\ufffd"] * 29  # 3 tokens behind
    assert "".join(deltas) == "\ufffd" * 32
    # A character split over 4 single-byte tokens is still held back until complete.
    snake = [byte_token(bytelevel, b) for b in "🐍".encode()]
    deltas = stream(bytelevel, [], [invalid] + snake + [invalid])
    assert "".join(deltas) == "\ufffd🐍\ufffd"
