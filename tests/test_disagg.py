"""Prefill/decode disaggregation at the engine level: a prefill engine and a decode engine in one
process, the K/V moving between them over real ZMQ TCP sockets on localhost. Greedy outputs must
equal the colocated engine's token for token, with or without a prefix the decode side already
holds, whatever the page size; every slot stays accounted for on both sides, also when the
prefill side is gone or answers for another model."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from banyan import Engine, SamplingParams
from banyan.scheduler.request import FinishReason
from tests.disagg_helpers import BACKENDS, has_mooncake

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _engine(model: Path, mode: str = "null", **kw: object) -> Engine:
    args: dict[str, object] = dict(dtype="float32", kv_cache_memory="4MiB", disable_tqdm=True,
                                   max_model_len=2100, chunked_prefill_size=512)
    args.update(kw)
    return Engine(str(model), disaggregation_mode=mode, **args)


def _check(engine: Engine) -> None:
    sched = engine.core.scheduler
    sched.kv.check_integrity(list(sched.running))
    assert not sched.running and not sched.waiting


def _pd_generate(prefill: Engine, decode: Engine, prompts: list[list[int]], max_new: int,
                 source: str | None = None) -> list[list[int]]:
    """What a P/D router does, by hand: each prompt to the prefill engine for one token, then to
    the decode engine naming the prefill engine's K/V address. The prefill engine answers
    fetches between the decode engine's steps (its engine loop would, between its own)."""
    assert prefill.core.kv_source is not None
    one = SamplingParams(max_new_tokens=1, **GREEDY)
    prefill.generate(input_ids=prompts, sampling_params=one, use_tqdm=False)
    outs: dict[str, list[int]] = {}
    params = SamplingParams(max_new_tokens=max_new, **GREEDY)
    for i, ids in enumerate(prompts):
        decode.core.add(f"r{i}", ids, params, kv_source=source or prefill.core.kv_source.address)
        outs[f"r{i}"] = []
    done = 0
    while done < len(prompts):
        prefill.core.kv_source.serve()
        for update in decode.core.step():
            assert update.error is None, update.error
            outs[update.rid] += update.new_token_ids
            done += update.finish_reason is not None
    return [outs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch,page_size", [("llama", 1), ("llama", 4), ("mistral", 1),
                                            ("qwen2", 4), ("qwen3", 1)])
def test_pd_outputs_equal_colocated(model_dirs: dict[str, Path], arch: str, page_size: int,
                                    backend: str) -> None:
    rng = random.Random(7)
    lengths = [1, 2, 5, 63, 300, 2000]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    model = model_dirs[arch]
    with _engine(model, page_size=page_size) as colocated:
        want = [o.outputs[0].output_ids for o in colocated.generate(
            input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=6, **GREEDY),
            use_tqdm=False)]
    pd = dict(page_size=page_size, disaggregation_transfer_backend=backend)
    with _engine(model, "prefill", **pd) as prefill, _engine(model, "decode", **pd) as decode:
        assert _pd_generate(prefill, decode, prompts, 6) == want
        sink = decode.core.kv_sink
        assert sink is not None
        expected = sum(decode.core.scheduler.kv.cache.aligned_len(n - 1) for n in lengths)
        assert sink.stats.received_tokens == expected and sink.stats.failed == 0
        assert decode.core.stats().prefix_hit == 0  # sent K/V is not a cache hit
        _check(prefill)
        _check(decode)


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_the_missing_part_moves(llama_dir: Path, backend: str) -> None:
    """A decode worker that holds a prefix (an earlier turn) fetches only the rest."""
    rng = random.Random(8)
    system = [rng.randrange(3, 500) for _ in range(200)]
    first, second = system + [11, 12, 13], system + [rng.randrange(3, 500) for _ in range(100)]
    with _engine(llama_dir) as colocated:
        want = [o.outputs[0].output_ids for o in colocated.generate(
            input_ids=[first, second], sampling_params=SamplingParams(max_new_tokens=5, **GREEDY),
            use_tqdm=False)]
    pd = dict(disaggregation_transfer_backend=backend)
    with _engine(llama_dir, "prefill", **pd) as prefill, \
            _engine(llama_dir, "decode", **pd) as decode:
        got = [_pd_generate(prefill, decode, [p], 5)[0] for p in (first, second)]
        assert got == want
        sink, source = decode.core.kv_sink, prefill.core.kv_source
        assert sink is not None and source is not None
        assert sink.stats.transfers == 2
        # The second fetch started past the 200 tokens the decode side shares with the first.
        assert source.stats.sent_tokens == (len(first) - 1) + (len(second) - 1 - len(system))
        _check(prefill)
        _check(decode)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_quantized_cache_moves_its_codes_and_scales(llama_dir: Path, backend: str,
                                                      kv: str) -> None:
    """With --kv-cache-dtype int8 on both sides, the K/V travels as codes and scales (half
    the bytes of float32 and less), and outputs equal the colocated int8 engine's; with fp8
    (no row scales) as codes alone."""
    rng = random.Random(13)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (2, 70, 260)]
    quant = dict(kv_cache_dtype=kv)
    with _engine(llama_dir, **quant) as colocated:
        want = [o.outputs[0].output_ids for o in colocated.generate(
            input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=6, **GREEDY),
            use_tqdm=False)]
        per_token = colocated.core.kv_bytes_per_token
    pd = dict(disaggregation_transfer_backend=backend, **quant)
    with _engine(llama_dir, "prefill", **pd) as prefill, \
            _engine(llama_dir, "decode", **pd) as decode:
        assert _pd_generate(prefill, decode, prompts, 6) == want
        sink = decode.core.kv_sink
        assert sink is not None and sink.stats.failed == 0
        assert sink.stats.received_bytes == sink.stats.received_tokens * per_token > 0
        _check(prefill)
        _check(decode)


def test_a_gone_prefill_worker_costs_time_not_requests(llama_dir: Path) -> None:
    """No reply (the prefill worker died): after the timeout the decode worker computes the
    prompt itself; outputs unchanged, nothing leaked."""
    prompt = [random.Random(9).randrange(3, 500) for _ in range(120)]
    with _engine(llama_dir) as colocated:
        want = colocated.generate(input_ids=[prompt], sampling_params=SamplingParams(
            max_new_tokens=5, **GREEDY), use_tqdm=False)[0].outputs[0].output_ids
    with _engine(llama_dir, "prefill") as prefill, \
            _engine(llama_dir, "decode", disaggregation_timeout=0.3) as decode:
        silent = "tcp://127.0.0.1:9"  # nobody answers (discard port)
        assert _pd_generate(prefill, decode, [prompt], 5, source=silent) == [want]
        sink = decode.core.kv_sink
        assert sink is not None and sink.stats.failed == 1 and sink.stats.received_tokens == 0
        _check(decode)


def test_a_prefill_worker_of_another_model_is_refused(model_dirs: dict[str, Path]) -> None:
    prompt = [random.Random(10).randrange(3, 500) for _ in range(80)]
    with _engine(model_dirs["llama"]) as colocated:
        want = colocated.generate(input_ids=[prompt], sampling_params=SamplingParams(
            max_new_tokens=4, **GREEDY), use_tqdm=False)[0].outputs[0].output_ids
    with _engine(model_dirs["mistral"], "prefill") as prefill, \
            _engine(model_dirs["llama"], "decode") as decode:
        assert _pd_generate(prefill, decode, [prompt], 4) == [want]
        assert prefill.core.kv_source is not None and prefill.core.kv_source.stats.refused == 1
        assert decode.core.kv_sink is not None and decode.core.kv_sink.stats.failed == 1
        _check(decode)


def test_abort_while_the_kv_travels_frees_the_reservation(llama_dir: Path) -> None:
    prompt = [random.Random(11).randrange(3, 500) for _ in range(150)]
    with _engine(llama_dir, "prefill") as prefill, _engine(llama_dir, "decode") as decode:
        assert prefill.core.kv_source is not None
        decode.core.add("x", prompt, SamplingParams(max_new_tokens=3, **GREEDY),
                        kv_source=prefill.core.kv_source.address)
        free_before = decode.core.stats().kv_free
        assert decode.core.is_waiting("x") and decode.core.has_work
        update = decode.core.abort("x")
        assert update is not None and update.finish_reason is FinishReason.ABORT
        assert decode.core.stats().kv_free > free_before  # the reserved slots came back
        assert not decode.core.has_work
        prefill.core.kv_source.serve()  # the late reply finds no transfer: dropped
        assert decode.core.step() == []
        _check(decode)


@pytest.mark.skipif(not has_mooncake(), reason="mooncake transfer engine missing")
def test_mooncake_slots_given_up_stay_reserved_until_the_reply(llama_dir: Path) -> None:
    """With mooncake the prefill worker writes into the decode worker's slots: an aborted
    transfer keeps them reserved until the reply says the writing is over, so they are never
    handed to another request while a write may still land in them."""
    prompt = [random.Random(12).randrange(3, 500) for _ in range(150)]
    pd = dict(disaggregation_transfer_backend="mooncake")
    with _engine(llama_dir, "prefill", **pd) as prefill, \
            _engine(llama_dir, "decode", **pd) as decode:
        prefill.generate(input_ids=[prompt], use_tqdm=False,
                         sampling_params=SamplingParams(max_new_tokens=1, **GREEDY))
        assert prefill.core.kv_source is not None and decode.core.kv_sink is not None
        free = decode.core.stats().kv_free
        decode.core.add("x", prompt, SamplingParams(max_new_tokens=3, **GREEDY),
                        kv_source=prefill.core.kv_source.address)
        decode.core.abort("x")
        assert decode.core.stats().kv_free < free and decode.core.kv_sink.pending
        _check(decode)  # quarantined slots are accounted for
        deadline = time.monotonic() + 30
        while decode.core.kv_sink.pending and time.monotonic() < deadline:
            prefill.core.kv_source.serve()  # once the fetch is there: writes, then replies
            decode.core.step()
        assert not decode.core.kv_sink.pending and decode.core.stats().kv_free == free
        _check(decode)


def test_kv_transfer_params_need_a_decode_worker(llama_dir: Path) -> None:
    with _engine(llama_dir) as engine, pytest.raises(ValueError, match="not a decode worker"):
        engine.core.add("x", [5, 6, 7], SamplingParams(max_new_tokens=2),
                        kv_source="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="disaggregation_kv_addr"):
        _engine(llama_dir, "prefill", disaggregation_kv_addr="tcp://0.0.0.0:5000")
    with pytest.raises(ValueError, match="disaggregation_prefill_nice"):
        _engine(llama_dir, "prefill", disaggregation_prefill_nice=25)
    with pytest.raises(ValueError, match="disaggregation_transfer_backend"):
        _engine(llama_dir, "decode", disaggregation_transfer_backend="rdma")


def test_a_prefill_worker_dying_mid_transfer_is_noticed_at_once(llama_dir: Path) -> None:
    """The fetch reached a prefill worker that then died (its socket closed, as kill -9 does):
    the decode worker sees the connection drop and computes the prompt itself, long before the
    timeout; outputs unchanged, nothing leaked."""
    import zmq

    prompt = [random.Random(14).randrange(3, 500) for _ in range(90)]
    with _engine(llama_dir) as colocated:
        want = colocated.generate(input_ids=[prompt], sampling_params=SamplingParams(
            max_new_tokens=4, **GREEDY), use_tqdm=False)[0].outputs[0].output_ids
    ctx = zmq.Context.instance()
    dying = ctx.socket(zmq.ROUTER)
    port = dying.bind_to_random_port("tcp://127.0.0.1")
    with _engine(llama_dir, "decode", disaggregation_timeout=60) as decode:
        decode.core.add("x", prompt, SamplingParams(max_new_tokens=4, **GREEDY),
                        kv_source=f"tcp://127.0.0.1:{port}")
        assert dying.poll(10_000), "the fetch did not arrive"
        dying.recv_multipart()
        dying.close(linger=0)  # dies without answering
        t0 = time.monotonic()
        out: list[int] = []
        while decode.core.has_work:
            for update in decode.core.step():
                out += update.new_token_ids
        assert time.monotonic() - t0 < 10 and out == want
        sink = decode.core.kv_sink
        assert sink is not None and sink.stats.failed == 1
        _check(decode)



def test_sinks_opening_and_closing_never_break_the_zmq_context() -> None:
    """A sink watches each DEALER with a monitor PAIR. pyzmq's default monitor address is named
    by the socket's file descriptor, which a later socket gets once the old one is closed, while
    libzmq may not have released the address yet: the fetch was then not sent (CI). And libzmq
    sends monitor events from its I/O thread, blocking there while they find no reader, so a
    monitor closed before its socket could freeze every socket of the context. Sinks open,
    fetch and close beside a closing ROUTER; every fetch must be sent and arrive."""
    import zmq

    from banyan.disagg.sink import KVSink

    ctx = zmq.Context()
    try:
        for i in range(1000):
            router = ctx.socket(zmq.ROUTER)
            port = router.bind_to_random_port("tcp://127.0.0.1")
            sink = KVSink(ctx, None, None, "m", 1.0)  # type: ignore[arg-type]  # sockets only
            sink._socket(f"tcp://127.0.0.1:{port}").send(b"fetch")
            assert router.poll(5_000), f"fetch {i} did not arrive: the context stalled"
            router.recv_multipart()
            sink.close()
            router.close(linger=0)
    finally:
        ctx.destroy(linger=0)
