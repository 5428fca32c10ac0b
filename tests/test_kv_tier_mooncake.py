"""The KV tier on Mooncake's distributed store: a real `mooncake_master`, engines joined to it
over TCP. Two server replicas share it: a prompt computed on one is loaded on the other."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from banyan import Engine, SamplingParams
from tests.server_helpers import free_port, start_server, wait_idle_and_free
from tests.http_client import HTTP

mooncake_store = pytest.importorskip(
    "mooncake.store", reason="mooncake-transfer-engine-non-cuda (and libibverbs1) not installed")


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A mooncake_master on free localhost ports; its RPC address."""
    binary = shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
    assert binary is not None, "mooncake_master is installed with the package"
    rpc, metrics = free_port(), free_port()
    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [binary, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1", f"--metrics_port={metrics}",
             "--metrics_host=127.0.0.1", "--enable_metric_reporting=false"],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"mooncake_master exited:\n{log.read_text()}"
            try:
                if HTTP.get(f"http://127.0.0.1:{metrics}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "mooncake_master did not come up"
            time.sleep(0.2)
        yield f"127.0.0.1:{rpc}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_engine_outputs_equal_with_the_mooncake_tier(llama_dir: Path, master: str) -> None:
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 500) for _ in range(230)] for _ in range(3)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    kw: dict[str, object] = dict(dtype="float32", device="cpu", disable_tqdm=True,
                                 kv_cache_memory="160KiB")
    with Engine(str(llama_dir), **kw) as engine:
        want = [engine.generate(input_ids=[p], sampling_params=params, use_tqdm=False)[0]
                .outputs[0].output_ids for p in prompts]
    with Engine(str(llama_dir), hicache_backend="mooncake", hicache_mooncake_master=master,
                hicache_size="64MiB", hicache_block_tokens=16, **kw) as engine:
        tier = engine.core.scheduler.kv.tier
        got = []
        for p in prompts + prompts:  # the second round finds its prefixes in the store only
            got.append(engine.generate(input_ids=[p], sampling_params=params, use_tqdm=False)[0]
                       .outputs[0].output_ids)
            tier.flush()
        assert got == want + want
        assert engine.core.scheduler.kv.tier_loaded >= 3 * 14 * 16


def test_two_replicas_share_the_store(llama_dir: Path, master: str, tmp_path: Path) -> None:
    rng = random.Random(9)
    prompt = [rng.randrange(3, 500) for _ in range(240)]
    flags = ("--hicache-backend", "mooncake", "--hicache-mooncake-master", master,
             "--hicache-size", "64MiB", "--hicache-block-tokens", "16")

    def complete(url: str) -> str:
        reply = HTTP.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True})
        reply.raise_for_status()
        return reply.json()["choices"][0]["text"]

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with ThreadPoolExecutor(2) as pool:  # both start at once
        starts = [pool.submit(start_server, llama_dir, tmp_path / d, "--served-model-name",
                              "tiny", *flags) for d in ("a", "b")]
    servers = [f.result() for f in starts if f.exception() is None]
    try:
        assert len(servers) == 2, f"a replica did not start: {[f.exception() for f in starts]}"
        a, b = servers
        text = complete(a.url)
        deadline = time.monotonic() + 30  # the write-through runs in the background
        while wait_idle_and_free(a.url)["hicache"]["saved_blocks"] < 15:
            assert time.monotonic() < deadline, "replica a never stored its blocks"
            time.sleep(0.2)
        assert complete(b.url) == text
        info = wait_idle_and_free(b.url)["hicache"]
        assert info["loaded_tokens"] >= 224 and info["saved_blocks"] == 0
    finally:
        codes = [srv.stop() for srv in servers]
    assert codes == [0, 0]
