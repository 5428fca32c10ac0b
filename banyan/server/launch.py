"""`banyan serve`: start the engine process, wait until it is ready, serve HTTP, and on SIGTERM
or SIGINT stop both.

The engine process is started with multiprocessing's spawn context (a fresh interpreter: safe
with CUDA, no inherited sockets or threads). Its arguments travel by pickle once at start-up,
between our own processes; everything after that goes over ZMQ as msgpack.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from banyan.args import EngineArgs
from banyan.model_files import (
    DEMO_SERVED_NAME,
    default_served_name,
    engine_model_arg,
    load_tokenizer,
    resolve_model_dir,
    sampling_defaults,
)
from banyan.server.args import ServerArgs

if TYPE_CHECKING:
    from banyan.server.tokens import TokenizerSide

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = DEMO_SERVED_NAME


def run_server(engine_args: EngineArgs, server_args: ServerArgs) -> int:
    level = getattr(logging, server_args.log_level.upper())
    logging.getLogger().setLevel(level)
    try:
        model_dir = resolve_model_dir(engine_args.model)  # builds the demo model once if needed
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    tokenizer_path = Path(engine_args.tokenizer) if engine_args.tokenizer else model_dir
    name = server_args.served_model_name or default_served_name(engine_args.model)
    engine_args = dataclasses.replace(engine_args,
                                      model=engine_model_arg(engine_args.model, model_dir))
    try:
        return asyncio.run(_serve(engine_args, server_args, name, str(model_dir), tokenizer_path,
                                  level))
    except KeyboardInterrupt:
        return 130


async def _serve(engine_args: EngineArgs, server_args: ServerArgs, model_name: str,
                 model_path: str, tokenizer_path: Path, level: int) -> int:
    from banyan.server.metrics import ServerMetrics
    from banyan.server.supervisor import EngineSupervisor, make_ipc_dir

    cache_info = {"block_size": str(engine_args.page_size),
                  "enable_prefix_caching": str(not engine_args.no_prefix_cache),
                  "cache_dtype": engine_args.dtype}
    supervisor = EngineSupervisor(engine_args, server_args, level,
                                  ServerMetrics(model_name, cache_info), make_ipc_dir())
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None
    # Until uvicorn installs its own handlers, SIGTERM cancels the start-up (and cleans up).
    loop.add_signal_handler(signal.SIGTERM, main_task.cancel)
    # The engine process is the long pole of the start (torch, weights): it is spawned first,
    # and the tokenizer (transformers) and the web stack (FastAPI: 0.7 s of imports on Zen 3)
    # load here while it starts.
    tok: TokenizerSide | None = None
    starting = asyncio.create_task(supervisor.start())
    await asyncio.sleep(0)  # start() runs up to its first wait: the process is spawned
    loading = asyncio.create_task(asyncio.to_thread(load_tokenizer, tokenizer_path))
    try:
        import uvicorn

        from banyan.server.api_server import build_app
        from banyan.server.state import ServerState
        from banyan.server.tokens import TokenizerSide

        try:
            client = await starting
        except RuntimeError as exc:
            await asyncio.wait({loading})
            bad_tokenizer = loading.exception()  # then the engine failed for the same reason
            logger.error("%s", bad_tokenizer or exc)
            return 2 if isinstance(bad_tokenizer, ValueError) else 1
        try:
            tokenizer = await loading
        except ValueError as exc:
            logger.error("%s", exc)
            return 2
        ready = client.info
        assert ready is not None
        logger.info("engine ready: max_model_len %d, KV cache %d tokens", ready.max_model_len,
                    ready.kv_capacity)
        tok = TokenizerSide(tokenizer, ready.vocab_size, server_args.tokenizer_threads,
                            server_args.tokenize_timeout)
        state = ServerState(server_args, engine_args, model_name, model_path, tok, client,
                            client.metrics, sampling_defaults(Path(model_path)))
        config = uvicorn.Config(
            build_app(state), host=server_args.host, port=server_args.port,
            log_level=server_args.log_level, access_log=server_args.access_log,
            timeout_graceful_shutdown=max(int(server_args.shutdown_timeout), 1), lifespan="off",
            timeout_keep_alive=5)
        server = uvicorn.Server(config)
        supervisor.on_client = lambda new: setattr(state, "client", new)
        supervisor.on_give_up = lambda: setattr(server, "should_exit", True)
        loop.remove_signal_handler(signal.SIGTERM)
        # uvicorn handles SIGINT/SIGTERM while serving (graceful shutdown), then restores the
        # previous handlers and raises the signal again: make that a no-op, so the cleanup below
        # runs instead of the process dying (SIG_DFL) or the cleanup being cancelled (asyncio's
        # SIGINT handler).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _ignore_signal)
        logger.info("serving %s on http://%s:%d", model_name, server_args.host,
                    server_args.port)
        await server.serve()
        return supervisor.exit_code if server.started else 1
    except asyncio.CancelledError:
        logger.info("start-up interrupted")
        return 143
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        await supervisor.stop(server_args.shutdown_timeout + 5.0)
        if tok is not None:
            tok.close()
        logger.info("server stopped")


def _ignore_signal(signum: int, frame: object) -> None:
    logger.info("signal %d: already shutting down", signum)
