"""Stand-in "other hosts" for tests and benchmarks: Linux network namespaces joined by veth pairs
to a bridge in the root namespace, so traffic between them really crosses network interfaces
(the kernel's TCP stack, veth, a bridge), unlike loopback. Needs root and iproute2.

    with Hosts(2) as hosts:                 # 10.x.y.1 and 10.x.y.2; the root side is .254
        subprocess.Popen(hosts.run(0, ["python", "-m", "banyan.cli", "serve", ...]))
"""

from __future__ import annotations

import os
import shutil
import subprocess
from types import TracebackType


def available() -> str | None:
    """None when namespaces joined by veth pairs on a bridge can be made here, else why not
    (one host is made and removed to find out)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    try:
        with Hosts(1):
            pass
    except RuntimeError as exc:
        return str(exc)
    return None


class Hosts:
    """n namespaces on one bridged /24; `address(i)` is host i's IP, `root` the root side's."""

    def __init__(self, n: int) -> None:
        tag = os.getpid() % 100000
        self.n = n
        self.prefix = f"10.{200 + tag % 50}.{tag % 250}"
        self.names = [f"bn{tag}h{i}" for i in range(n)]
        self.bridge = f"bn{tag}br"
        self.root = f"{self.prefix}.254"

    def address(self, i: int) -> str:
        return f"{self.prefix}.{i + 1}"

    def run(self, i: int, cmd: list[str]) -> list[str]:
        """cmd, to be run inside host i."""
        return ["ip", "netns", "exec", self.names[i], *cmd]

    def __enter__(self) -> Hosts:
        try:
            self._ip("link", "add", self.bridge, "type", "bridge")
            self._ip("addr", "add", f"{self.root}/24", "dev", self.bridge)
            self._ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self.names):
                inner, outer = f"{name}i", f"{name}o"
                self._ip("netns", "add", name)
                self._ip("link", "add", inner, "type", "veth", "peer", "name", outer)
                self._ip("link", "set", inner, "netns", name)
                self._ip("link", "set", outer, "master", self.bridge)
                self._ip("link", "set", outer, "up")
                self._ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", inner)
                self._ip("-n", name, "link", "set", inner, "up")
                self._ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Remove what was made (a namespace's veth end goes with it); never raises."""
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            subprocess.run(["ip", "link", "del", f"{name}o"], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    @staticmethod
    def _ip(*args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
