"""Messages between the API server process and the engine process, and the ZMQ sockets that carry
them.

Every message is a msgspec Struct encoded as msgpack: typed, fast, and never pickle (a socket
that unpickles can be made to run code). Two PUSH/PULL channels, both bound by the API server
(it creates the ipc:// paths) and connected by the engine:

    API server --requests--> engine      AddRequest | AbortRequest | ControlRequest | Shutdown
    engine     --outputs-->  API server  EngineReady | EngineFailed | UpdateBatch | ControlReply

PUSH/PULL keeps the order of one sender's messages, so an abort never overtakes its add.
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq
import zmq.asyncio

from banyan.batch import TokenLogprobs
from banyan.sampling.params import SamplingParams

# ---- API server -> engine ---------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add"):
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: str | None = None  # cache_salt
    kv_source: str | None = None  # decode worker: the prefill worker holding the prompt's K/V


class AbortRequest(msgspec.Struct, tag="abort"):
    rid: str  # a user request id: all its samples (rid#k) are aborted


class ControlRequest(msgspec.Struct, tag="control"):
    """A question to the engine answered by one ControlReply with the same id."""

    id: int
    kind: str  # "info" | "flush_cache" | "ping"


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


ToEngine = AddRequest | AbortRequest | ControlRequest | Shutdown

# ---- engine -> API server ---------------------------------------------------------------------


class EngineReady(msgspec.Struct, tag="ready"):
    pid: int
    max_model_len: int
    vocab_size: int
    kv_capacity: int  # KV slots (tokens) in the pool
    eos_ids: list[int]
    kv_source: str = ""  # prefill worker: where decode workers fetch its K/V


class EngineFailed(msgspec.Struct, tag="failed"):
    message: str


class Update(msgspec.Struct, array_like=True):
    """What one step did to one request (sample): scheduler.RequestUpdate on the wire."""

    rid: str
    token_ids: list[int]
    text: str  # incremental, already detokenized and stop-string trimmed by the engine
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprobs] = []
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    # The engine refused the request when adding it: the HTTP status to answer with (400 for
    # bad input, 500 for an internal error); 0 otherwise. `rid` is then the user request id.
    refused: int = 0
    # The prompt's logprobs (entry i scores prompt token i + 1), once, with the first token.
    prompt_logprobs: list[TokenLogprobs] = []
    # Seconds the request waited in the engine's queue before first scheduled, on the first
    # update after its admission (-1: not this update), for per-request prefill/decode times.
    queue_time: float = -1.0


class StepTimes(msgspec.Struct):
    """Seconds spent by the engine loop, by phase, summed over the steps since start."""

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    output: float = 0.0
    other: float = 0.0  # the loop around the step: receiving requests, sending outputs
    wall: float = 0.0  # loop iterations that ran a step, end to end

    @property
    def busy(self) -> float:
        """Time the device computed: the forward and the sampler (which waits for the device
        on CUDA). The rest of `wall` is execution-idle: the device waited on the host."""
        return self.forward + self.sample


class EngineStats(msgspec.Struct):
    num_running: int = 0
    num_waiting: int = 0
    kv_capacity: int = 0
    kv_free: int = 0  # slots holding no KV: on the free list or in decode runs
    kv_evictable: int = 0  # cached, held by no running request: free on demand
    kv_protected: int = 0  # cached and locked by running requests
    prompt_tokens: int = 0  # prompt tokens of requests admitted (first admission)
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # tokens served from it
    retractions: int = 0
    steps: int = 0
    times: StepTimes = msgspec.field(default_factory=StepTimes)
    busy_fraction: float = 0.0  # device-busy share of the wall time of the recent steps
    last_step: dict[str, float] = {}
    # Speculative decoding (vLLM's meaning): a draft is one request's guesses in one step.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    hicache: dict[str, float] = {}  # the KV tier's counters (KVTier.counters); empty when off
    disagg: dict[str, float] = {}  # P/D: the KV transfer's counters; empty for a plain worker
    head_screen: list[int] = []  # [screened, fallen back] one-token greedy steps; empty: none

    @property
    def kv_usage(self) -> float:
        """Fraction of the pool that is not free (evictable cache counts as free: vLLM's
        kv_cache_usage_perc)."""
        if self.kv_capacity == 0:
            return 0.0
        return (self.kv_capacity - self.kv_free - self.kv_evictable) / self.kv_capacity


class UpdateBatch(msgspec.Struct, tag="batch"):
    """Everything one engine step produced, in one message (one per step, not one per token)."""

    updates: list[Update]
    stats: EngineStats
    queue_times: list[float] = []  # seconds waited by requests first admitted in this step


class ControlReply(msgspec.Struct, tag="reply"):
    id: int
    ok: bool
    message: str = ""
    data: dict[str, Any] = {}


FromEngine = EngineReady | EngineFailed | UpdateBatch | ControlReply

# ---- sockets ----------------------------------------------------------------------------------


class PushSocket:
    """Non-blocking typed sender (sync socket: usable from the asyncio loop and from cancelled
    tasks, where an `await` would not run)."""

    def __init__(self, ctx: zmq.Context, address: str, bind: bool) -> None:
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow reader
        if bind:
            self._sock.bind(address)
        else:
            self._sock.connect(address)
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, msg: msgspec.Struct) -> None:
        """Raise zmq.Again when no peer is connected."""
        self.send_bytes(self._encoder.encode(msg))

    def encode(self, msg: msgspec.Struct) -> bytes:
        """The message's bytes; raises (msgspec.EncodeError, OverflowError, ...) for values
        msgpack cannot carry, before anything is sent."""
        return self._encoder.encode(msg)

    def send_bytes(self, data: bytes) -> None:
        self._sock.send(data, flags=zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        self._sock.close(linger=0)


class PullSocket:
    """Typed receiver for the engine's synchronous loop."""

    def __init__(self, ctx: zmq.Context, address: str, bind: bool, kind: Any) -> None:
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        if bind:
            self._sock.bind(address)
        else:
            self._sock.connect(address)
        self._decoder = msgspec.msgpack.Decoder(kind)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    @property
    def socket(self) -> zmq.Socket:
        return self._sock

    def poll(self, timeout_ms: int) -> bool:
        return bool(self._poller.poll(timeout_ms))

    def recv_nowait(self) -> Any | None:
        try:
            data = self._sock.recv(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self._decoder.decode(data.buffer)

    def close(self) -> None:
        self._sock.close(linger=0)


class AsyncPullSocket:
    """Typed receiver for the API server's asyncio loop."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, bind: bool, kind: Any) -> None:
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        if bind:
            self._sock.bind(address)
        else:
            self._sock.connect(address)
        self._decoder = msgspec.msgpack.Decoder(kind)

    async def recv(self) -> Any:
        data = await self._sock.recv(copy=False)
        return self._decoder.decode(data.buffer)

    def close(self) -> None:
        self._sock.close(linger=0)
