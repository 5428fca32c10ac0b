"""`banyan route ...` and the `--dp N` part of `banyan serve`: parsers and dispatch."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from banyan.args import EngineArgs, add_dataclass_args
from banyan.router.args import SERVE_SKIP, RouterArgs
from banyan.server.args import ServerArgs


def add_route_parser(sub: Any) -> None:
    route = sub.add_parser("route", help="route requests to engine replicas (cache-aware, "
                                         "load-aware, with failover)")
    group = route.add_argument_group("router")
    group.add_argument("--worker", dest="workers", action="append", default=[],
                       metavar="URL", help="an engine replica, http://host:port (repeatable)")
    group.add_argument("--decode", dest="workers", action="append", metavar="URL",
                       help="--pd: a decode worker (the same list as --worker)")
    group.add_argument("--prefill", dest="prefill_workers", action="append", default=[],
                       metavar="URL", help="--pd: a prefill worker (repeatable)")
    add_dataclass_args(group, RouterArgs, skip={"workers", "prefill_workers"})
    route.set_defaults(func=cmd_route)


def add_dp_args(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "data parallel", "With --dp N > 1: N engine replicas, each its own processes with "
        "1/N of --num-threads, behind the router on --host/--port.")
    group.add_argument("--dp", type=int, default=1,
                       help="Engine replicas to start behind a router (1: no router).")
    group.add_argument("--pd", default=None, metavar="P:D",
                       help="Prefill/decode disaggregation: P prefill and D decode replicas "
                            "behind a --pd router (instead of --dp).")
    add_dataclass_args(group, RouterArgs, skip=set(SERVE_SKIP))


def cmd_route(ns: argparse.Namespace) -> int:
    from banyan.router.launch import run_router

    try:
        args = RouterArgs.from_namespace(ns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_router(args)


def run_serve_dp(ns: argparse.Namespace, engine_args: EngineArgs,
                 server_args: ServerArgs) -> int:
    from banyan.router.launch import run_dp

    try:
        roles = replica_roles(ns.dp, ns.pd)
        router_args = RouterArgs.from_namespace(
            ns, host=server_args.host, port=server_args.port, workers=[],
            api_key=server_args.api_key, log_level=server_args.log_level,
            max_request_bytes=server_args.max_request_bytes, access_log=server_args.access_log,
            request_body_timeout=server_args.request_body_timeout, pd=ns.pd is not None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_dp(engine_args, server_args, router_args, roles)


def replica_roles(dp: int, pd: str | None) -> list[str]:
    """Each replica's --disaggregation-mode: --dp N gives N plain ones, --pd P:D P prefill and
    D decode ones."""
    if pd is None:
        if dp < 1:
            raise ValueError(f"dp must be >= 1, got {dp}")
        return ["null"] * dp
    if dp != 1:
        raise ValueError("give --dp or --pd, not both")
    try:
        p, d = (int(x) for x in pd.split(":"))
    except ValueError:
        raise ValueError(f"--pd takes P:D (prefill and decode replicas), got {pd!r}") from None
    if p < 1 or d < 1:
        raise ValueError(f"--pd needs at least one replica of each kind, got {pd!r}")
    return ["prefill"] * p + ["decode"] * d
