"""generation_config.json's sampling values apply where a request is silent, and only there."""

from __future__ import annotations

import json
from pathlib import Path

from banyan.model_files import sampling_defaults
from banyan.server.protocol import ChatCompletionRequest


def test_request_silence_takes_the_model_defaults(tmp_path: Path) -> None:
    assert sampling_defaults(tmp_path) == {}  # no file: OpenAI's defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20}))
    defaults = sampling_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20.0}
    silent = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}])
    p = silent.sampling_params(8, None, defaults)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 20, 1.0)
    explicit = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}],
                                     temperature=0, top_k=-1)
    p = explicit.sampling_params(8, None, defaults)
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 0.9, -1)
    p = silent.sampling_params(8, None)
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, -1)
