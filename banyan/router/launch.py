"""Processes: `banyan route` (the router alone) and `banyan serve --dp N` (N engine replicas, each
a `banyan serve` process of its own on a free localhost port, plus the router in this process).

A replica whose process exits is started again on its port (bounded by --max-engine-restarts,
with a doubling pause); the router's health checks take it out and bring it back.

SIGTERM or SIGINT stops the router gracefully (open requests get --shutdown-timeout), then the
replicas (SIGTERM, SIGKILL if they outstay their own shutdown). On Linux the replicas also get
SIGTERM if this process dies without cleaning up (PR_SET_PDEATHSIG), so none is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from typing import Any

import httpx

from banyan.args import EngineArgs
from banyan.router.args import RouterArgs
from banyan.server.args import ServerArgs

logger = logging.getLogger(__name__)


# ---- the router --------------------------------------------------------------------------------


def _set_log_level(level: str) -> None:
    logging.getLogger().setLevel(getattr(logging, level.upper()))
    # httpx logs every request at INFO: the health checks alone would flood the log.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def run_router(args: RouterArgs) -> int:
    _set_log_level(args.log_level)
    if not args.workers:
        logger.warning("no --worker given: add workers with POST /workers")
    try:
        return asyncio.run(_serve_router(args))
    except KeyboardInterrupt:
        return 130


async def _serve_router(args: RouterArgs) -> int:
    import uvicorn

    from banyan.router.app import build_app, build_router

    router = build_router(args)
    try:
        await router.start()
        config = uvicorn.Config(build_app(router), host=args.host, port=args.port,
                                log_level=args.log_level, access_log=args.access_log,
                                lifespan="off", timeout_keep_alive=5,
                                timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)
        # As in banyan.server.launch: uvicorn re-raises the signal it caught after serving;
        # with these handlers that is a no-op and the cleanup below runs.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _ignore_signal)
        logger.info("router (%s) on http://%s:%d", args.policy, args.host, args.port)
        await server.serve()
        return 0 if server.started else 1
    finally:
        await router.stop()
        logger.info("router stopped")


def _ignore_signal(signum: int, frame: object) -> None:
    logger.info("signal %d: already shutting down", signum)


# ---- serve --dp N ------------------------------------------------------------------------------


def dataclass_argv(obj: Any) -> list[str]:
    """The command-line flags that rebuild `obj` (a flat argument dataclass) in a child."""
    argv: list[str] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        flag = "--" + f.name.replace("_", "-")
        if value is None or value is False:
            continue
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def free_port(host: str = "127.0.0.1", taken: Collection[int] = ()) -> int:
    """A port nothing is bound to now, not among `taken`: bind(0) hands a just-closed port out
    again (two picks apart about once in 3,000 here), and of two servers given one port the
    later fails to bind while the earlier answers its health checks."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in taken:
            return port


def _parent_death_signal() -> Callable[[], None] | None:
    """A preexec_fn that makes the child get SIGTERM when this process dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: nothing to import after fork
    pr_set_pdeathsig = 1
    return lambda: libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def replica_devices(device: str, dp: int, cuda_count: int) -> list[str]:
    """The device of each of dp replicas: GPU i for replica i on a CUDA machine (ValueError
    when there are fewer GPUs than replicas), the CPU for all otherwise."""
    on_cuda = device.startswith("cuda") or (device == "auto" and cuda_count > 0)
    if not on_cuda:
        return [device] * dp
    if dp > 1 and ":" in device:
        raise ValueError(f"--dp {dp} gives each replica its own GPU: use --device cuda or "
                         f"auto, not {device}")
    if cuda_count < dp:
        raise ValueError(f"--dp {dp} needs {dp} GPUs, this machine has {cuda_count}")
    return [f"cuda:{i}" for i in range(dp)] if dp > 1 else [device]


@dataclasses.dataclass(slots=True)
class Replica:
    """One `banyan serve` child: how to start it again, and how often it was restarted."""

    proc: subprocess.Popen[bytes]
    url: str
    cmd: list[str]
    env: dict[str, str]
    role: str = "null"  # its --disaggregation-mode
    restarts: int = 0
    restart_at: float | None = None  # time.monotonic() of the planned restart


def start_replicas(engine_args: EngineArgs, server_args: ServerArgs,
                   roles: list[str]) -> list[Replica]:
    """One `banyan serve` process per role (its --disaggregation-mode) on free localhost ports,
    the CPU threads split between them.
    Started before any thread exists here (preexec_fn). The API key travels in the environment,
    not on the command line, which every user of the machine can read."""
    dp = len(roles)
    threads = engine_args.num_threads or os.cpu_count() or 1
    per_replica = max(1, threads // dp)
    env = dict(os.environ)
    if server_args.api_key is not None:
        env["BANYAN_API_KEY"] = server_args.api_key
    import torch  # only to count GPUs: the router itself never touches a device

    devices = replica_devices(engine_args.device, dp, torch.cuda.device_count())
    replicas: list[Replica] = []
    ports: list[int] = []
    for i in range(dp):
        port = free_port(taken=ports)
        ports.append(port)
        e = dataclasses.replace(engine_args, num_threads=per_replica, device=devices[i],
                                disaggregation_mode=roles[i])
        s = dataclasses.replace(server_args, host="127.0.0.1", port=port, api_key=None)
        cmd = [sys.executable, "-m", "banyan.cli", "serve", *dataclass_argv(e),
               *dataclass_argv(s)]
        proc = _spawn(cmd, env)
        logger.info("replica %d (%s): pid %d on port %d, %d thread(s)", i, roles[i], proc.pid,
                    port, per_replica)
        replicas.append(Replica(proc, f"http://127.0.0.1:{port}", cmd, env, roles[i]))
    return replicas


def _spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, env=env, preexec_fn=_parent_death_signal())  # noqa: PLW1509


async def supervise_replicas(replicas: list[Replica], max_restarts: int,
                             backoff: float) -> None:
    """Forever: a replica whose process exited is started again on its port (the router's
    health checks bring it back into rotation), after a pause that doubles each time, at most
    max_restarts times per replica."""
    while True:
        await asyncio.sleep(0.5)
        now = time.monotonic()
        for r in replicas:
            if r.proc.poll() is None:
                continue
            if r.restart_at is None:
                if r.restarts >= max_restarts:
                    continue  # given up on: the router keeps it out of rotation
                r.restart_at = now + backoff * 2 ** r.restarts
                logger.error("replica %s exited with %s; restarting it in %.1f s", r.url,
                             r.proc.returncode, r.restart_at - now)
            elif now >= r.restart_at:
                r.restarts += 1
                r.restart_at = None
                r.proc = _spawn(r.cmd, r.env)
                logger.warning("replica %s restarted (pid %d, restart %d of %d)", r.url,
                               r.proc.pid, r.restarts, max_restarts)


def stop_replicas(replicas: list[Replica], timeout: float) -> None:
    for r in replicas:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for r in replicas:
        try:
            r.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            logger.warning("replica %s did not stop in %.0f s: killing it", r.url, timeout)
            r.proc.kill()
            r.proc.wait()


async def wait_healthy(replicas: list[Replica], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = {r.url: r for r in replicas}
    async with httpx.AsyncClient(timeout=2.0) as client:
        while pending:
            for url, r in list(pending.items()):
                if r.proc.poll() is not None:
                    raise RuntimeError(f"replica {url} exited with {r.proc.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{url}/health")).status_code == 200:
                        del pending[url]
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas not healthy after {timeout:.0f} s: "
                                   f"{sorted(pending)}")
            if pending:
                await asyncio.sleep(0.2)


def run_dp(engine_args: EngineArgs, server_args: ServerArgs, router_args: RouterArgs,
           roles: list[str]) -> int:
    from banyan.model_files import default_served_name, engine_model_arg, resolve_model_dir

    _set_log_level(server_args.log_level)
    try:
        model_dir = resolve_model_dir(engine_args.model)  # the demo model: built once, here
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    # Every replica serves under the name a single `banyan serve` would have used.
    server_args = dataclasses.replace(
        server_args, served_model_name=(server_args.served_model_name
                                        or default_served_name(engine_args.model)))
    engine_args = dataclasses.replace(engine_args,
                                      model=engine_model_arg(engine_args.model, model_dir))
    try:
        replicas = start_replicas(engine_args, server_args, roles)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    try:
        return asyncio.run(_dp_main(replicas, server_args, router_args))
    except KeyboardInterrupt:
        return 130
    finally:
        stop_replicas(replicas, server_args.shutdown_timeout + 15.0)
        logger.info("replicas stopped")


async def _dp_main(replicas: list[Replica], server_args: ServerArgs,
                   router_args: RouterArgs) -> int:
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None
    loop.add_signal_handler(signal.SIGTERM, main_task.cancel)  # until uvicorn's handlers
    try:
        await wait_healthy(replicas, server_args.engine_start_timeout + 30.0)
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 1
    except asyncio.CancelledError:
        logger.info("start-up interrupted")
        return 143
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    logger.info("%d replicas healthy", len(replicas))
    args = dataclasses.replace(
        router_args, workers=[r.url for r in replicas if r.role != "prefill"],
        prefill_workers=[r.url for r in replicas if r.role == "prefill"])
    keeper = loop.create_task(supervise_replicas(replicas, server_args.max_engine_restarts,
                                                 server_args.engine_restart_backoff))
    try:
        return await _serve_router(args)
    finally:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
