"""Prefill/decode disaggregation across "hosts": the prefill and the decode worker each in its own
network namespace (veth pairs on a bridge, addresses the test makes itself), so the K/V crosses
real network interfaces; the router in the root namespace. Outputs must equal a colocated
engine's, for both transfer backends. Needs root and iproute2 (skipped otherwise)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from banyan import Engine, SamplingParams
from banyan.bench import netns
from tests.disagg_helpers import BACKENDS
from tests.router_helpers import REPLICA_ARGS, start_processes, start_router, stop_all
from tests.server_helpers import wait_idle_and_free
from tests.http_client import HTTP

WHY_NOT = netns.available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
PORT = 31000  # each namespace has its own ports


@pytest.mark.parametrize("backend", BACKENDS)
def test_pd_across_network_namespaces(llama_dir: Path, tmp_path: Path, backend: str) -> None:
    rng = random.Random(13)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (700, 40)]
    with Engine(str(llama_dir), dtype="float32", kv_cache_memory="32MiB",
                disable_tqdm=True) as colocated:
        want = [o.outputs[0].output_ids for o in colocated.generate(
            input_ids=prompts, use_tqdm=False,
            sampling_params=SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))]
    with netns.Hosts(2) as hosts:
        cmds = []
        for i, mode in enumerate(("prefill", "decode")):
            host = hosts.address(i)
            cmds.append((hosts.run(i, [
                sys.executable, "-m", "banyan.cli", "serve", "--model", str(llama_dir),
                "--host", host, "--port", str(PORT), *REPLICA_ARGS,
                "--disaggregation-mode", mode, "--disaggregation-kv-addr", f"tcp://{host}:0",
                "--disaggregation-transfer-backend", backend]), PORT, mode))
        workers = start_processes(cmds, tmp_path, "/health",
                                  [hosts.address(0), hosts.address(1)])
        try:
            router = start_router([workers[1].url], tmp_path, "--pd", "--prefill",
                                  workers[0].url)
            try:
                for prompt, expected in zip(prompts, want):
                    r = HTTP.post(f"{router.url}/generate", timeout=120, json={
                        "input_ids": prompt, "sampling_params": {
                            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
                    assert r.status_code == 200, r.text
                    assert r.json()["output_ids"] == expected
                    assert r.headers["x-banyan-worker"] == workers[1].url
            finally:
                assert router.stop() == 0, router.log()
            decode = wait_idle_and_free(workers[1].url)["disaggregation"]
            prefill = wait_idle_and_free(workers[0].url)["disaggregation"]
            assert prefill["kv_addr"].startswith(f"tcp://{hosts.address(0)}:")
            assert decode["failed"] == 0
            assert decode["received_tokens"] == sum(len(p) - 1 for p in prompts)
        finally:
            stop_all(workers)
