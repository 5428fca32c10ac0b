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
    add_dataclass_args(group, RouterArgs, skip={"workers"})
    route.set_defaults(func=cmd_route)


def add_dp_args(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "data parallel", "With --dp N > 1: N engine replicas, each its own processes with "
        "1/N of --num-threads, behind the router on --host/--port.")
    group.add_argument("--dp", type=int, default=1,
                       help="Engine replicas to start behind a router (1: no router).")
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

    if ns.dp < 1:
        print(f"error: dp must be >= 1, got {ns.dp}", file=sys.stderr)
        return 2
    try:
        router_args = RouterArgs.from_namespace(
            ns, host=server_args.host, port=server_args.port, workers=[],
            api_key=server_args.api_key, log_level=server_args.log_level,
            max_request_bytes=server_args.max_request_bytes, access_log=server_args.access_log,
            request_body_timeout=server_args.request_body_timeout)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_dp(engine_args, server_args, router_args, ns.dp)
