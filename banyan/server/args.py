"""Server arguments: one dataclass whose field docs are the `banyan serve --help` text (the
engine's own flags come from EngineArgs)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from banyan.args import _doc


@dataclass(slots=True)
class ServerArgs:
    host: str = field(default="127.0.0.1", metadata=_doc(
        "Address to listen on. The default serves this machine only; 0.0.0.0 serves the network "
        "(set --api-key then)."))
    port: int = field(default=30000, metadata=_doc("TCP port to listen on."))
    api_key: str | None = field(default=None, metadata=_doc(
        "When set, every endpoint but /health and /metrics needs `Authorization: Bearer KEY`. "
        "Default: the BANYAN_API_KEY environment variable (which, unlike the command line, "
        "other users of the machine cannot read)."))
    served_model_name: str | None = field(default=None, metadata=_doc(
        "Model name in the API (the `model` field). Default: the --model argument as given, "
        "'SmolLM2-135M-Instruct' without --model, 'banyan-demo' for --model demo. Requests may "
        "name it or leave `model` out."))
    max_request_bytes: int = field(default=2 * 1024 * 1024, metadata=_doc(
        "Largest request body accepted, in bytes (larger: HTTP 413), checked before anything is "
        "parsed or tokenized. 2 MiB holds a 128k-token prompt as text or as token ids."))
    request_body_timeout: float = field(default=30.0, metadata=_doc(
        "Seconds a client may take to send its request body (longer: HTTP 408)."))
    tokenize_timeout: float = field(default=10.0, metadata=_doc(
        "Seconds rendering the chat template and tokenizing one request's prompts may take "
        "(longer: HTTP 400). Both run in a thread pool, never on the event loop."))
    tokenizer_threads: int = field(default=4, metadata=_doc(
        "Threads that render chat templates and tokenize prompts."))
    trust_request_chat_template: bool = field(default=False, metadata=_doc(
        "Accept a chat template sent in a request (chat_template, or chat_template_kwargs' "
        "chat_template). Off by default: a template is a program, and the server would run "
        "any client's."))
    max_engine_restarts: int = field(default=3, metadata=_doc(
        "Times the API server restarts an engine process that died; past that (or with 0) the "
        "server exits with a non-zero code, for a supervisor (systemd, Kubernetes) to act."))
    engine_restart_backoff: float = field(default=1.0, metadata=_doc(
        "Seconds before the first engine restart; doubled for each further one."))
    tool_call_parser: str = field(default="hermes", metadata=_doc(
        "How tool calls are read out of chat output: hermes (Hermes/Qwen "
        "<tool_call>{json}</tool_call>), or none (tools are refused).",
        choices=["hermes", "none"]))
    max_n: int = field(default=16, metadata=_doc(
        "Largest `n` (samples per prompt) accepted."))
    max_prompts: int = field(default=256, metadata=_doc(
        "Most prompts in one /v1/completions or /generate request."))
    engine_start_timeout: float = field(default=600.0, metadata=_doc(
        "Seconds to wait for the engine process to load the model before giving up."))
    shutdown_timeout: float = field(default=5.0, metadata=_doc(
        "On SIGTERM, seconds open requests get to finish before they are cut."))
    log_level: str = field(default="info", metadata=_doc(
        "Logging level of the server and engine.",
        choices=["debug", "info", "warning", "error"]))
    access_log: bool = field(default=False, metadata=_doc("Log one line per HTTP request."))

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is None:
            self.api_key = os.environ.get("BANYAN_API_KEY") or None
        for name in ("request_body_timeout", "tokenize_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_engine_restarts < 0 or self.engine_restart_backoff < 0:
            raise ValueError("max_engine_restarts and engine_restart_backoff must be >= 0")
        for name in ("max_request_bytes", "max_n", "max_prompts", "tokenizer_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
