"""The engine process's keeper: starts it, and when it dies, starts a new one (a bounded number
of times, with a growing pause) or stops the server with a non-zero exit code, so that a
supervisor above it (systemd, Kubernetes, `serve --dp`) can act.

While the engine is down, requests get 503 and /health says so. Each engine gets sockets of its
own (a generation number in the ipc:// path), so nothing the dead one sent can reach the next.
The IPC directory of a server that was killed (SIGKILL: no cleanup) is removed by the next
server that starts, once its owner process is gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from banyan.args import EngineArgs
from banyan.server.args import ServerArgs
from banyan.server.engine_client import EngineClient
from banyan.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

IPC_PREFIX = "banyan-ipc-"
_IPC_NAME = re.compile(re.escape(IPC_PREFIX) + r"(\d+)-")


def make_ipc_dir() -> str:
    """A private directory for this server's sockets, named after its pid (for the cleanup)."""
    remove_stale_ipc_dirs()
    return tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")


def remove_stale_ipc_dirs(root: str | None = None) -> list[str]:
    """Remove IPC directories of ours whose server process no longer exists."""
    removed = []
    base = Path(root or tempfile.gettempdir())
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _IPC_NAME.match(entry.name)
        if match is None or not entry.is_dir() or entry.is_symlink():
            continue
        try:
            if entry.stat().st_uid != os.getuid() or _alive(int(match.group(1))):
                continue
        except OSError:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(str(entry))
    if removed:
        logger.info("removed %d IPC director(ies) left by servers that were killed", len(removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclasses.dataclass(slots=True)
class EngineSupervisor:
    engine_args: EngineArgs
    server_args: ServerArgs
    log_level: int
    metrics: ServerMetrics
    ipc_dir: str
    client: EngineClient | None = None
    generation: int = 0
    restarts: int = 0
    exit_code: int = 0
    # Called with each new client (the server state swaps it in), and to stop the server.
    on_client: Callable[[EngineClient], None] = lambda client: None
    on_give_up: Callable[[], None] = lambda: None
    _task: asyncio.Task[None] | None = None

    async def start(self) -> EngineClient:
        """A new engine process, ready; RuntimeError when it fails to start."""
        from banyan.server.engine_proc import engine_main

        self.generation += 1
        inbox = f"ipc://{self.ipc_dir}/to-engine-{self.generation}"
        outbox = f"ipc://{self.ipc_dir}/from-engine-{self.generation}"
        process = multiprocessing.get_context("spawn").Process(
            target=engine_main, args=(self.engine_args, inbox, outbox, os.getpid(),
                                      self.log_level),
            name="banyan-engine", daemon=True)
        client = EngineClient(process, inbox, outbox, self.metrics)
        client.on_dead = self._on_dead
        self.client = client
        process.start()
        logger.info("engine process %d starting (model %s)", process.pid, self.engine_args.model)
        try:
            await client.wait_ready(self.server_args.engine_start_timeout)
        except BaseException:
            await client.shutdown(5.0)
            raise
        return client

    def _on_dead(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        dead = self.client
        assert dead is not None
        await dead.shutdown(1.0)  # reaps the process (no zombie) and closes its sockets
        logger.error("the engine process %s died (exit code %s)", dead.process.pid,
                     dead.process.exitcode)
        limit = self.server_args.max_engine_restarts
        while self.restarts < limit:
            delay = self.server_args.engine_restart_backoff * 2 ** self.restarts
            self.restarts += 1
            logger.warning("restarting the engine in %.1f s (restart %d of %d)", delay,
                           self.restarts, limit)
            await asyncio.sleep(delay)
            try:
                client = await self.start()
            except RuntimeError as exc:
                logger.error("engine restart failed: %s", exc)
                continue
            self.on_client(client)
            logger.info("engine restarted (pid %s)", client.process.pid)
            return
        logger.error("the engine died and %d restart(s) are used up: the server exits",
                     self.restarts)
        self.exit_code = 1
        self.on_give_up()

    async def stop(self, timeout: float) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        if self.client is not None:
            await self.client.shutdown(timeout)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        _stop_resource_tracker()


def _stop_resource_tracker() -> None:
    """Stops and reaps the helper process that the spawn start method runs beside the server,
    once no engine is left: otherwise it outlives the server and, orphaned, waits as a zombie
    until init reaps it (1-2 s seen in a container), holding the process group a supervisor
    waits on. (A private function of multiprocessing, present since Python 3.8: skipped where
    it is gone.)"""
    from multiprocessing import resource_tracker

    stop = getattr(getattr(resource_tracker, "_resource_tracker", None), "_stop", None)
    if callable(stop):
        try:
            stop()
        except (OSError, RuntimeError) as exc:  # the server is exiting: not worth failing it
            logger.debug("resource tracker not stopped: %s", exc)
