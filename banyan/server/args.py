"""Server arguments: one dataclass whose field docs are the `banyan serve --help` text (the
engine's own flags come from EngineArgs)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from banyan.args import _doc


@dataclass(slots=True)
class ServerArgs:
    host: str = field(default="127.0.0.1", metadata=_doc(
        "Address to listen on. The default serves this machine only; 0.0.0.0 serves the network "
        "(set --api-key then)."))
    port: int = field(default=30000, metadata=_doc("TCP port to listen on."))
    api_key: str | None = field(default=None, metadata=_doc(
        "When set, every endpoint but /health and /metrics needs `Authorization: Bearer KEY`."))
    served_model_name: str | None = field(default=None, metadata=_doc(
        "Model name in the API (the `model` field). Default: the --model argument as given, "
        "'SmolLM2-135M-Instruct' without --model, 'banyan-demo' for --model demo. Requests may "
        "name it or leave `model` out."))
    max_request_bytes: int = field(default=8 * 1024 * 1024, metadata=_doc(
        "Largest request body accepted, in bytes (larger: HTTP 413)."))
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
        for name in ("max_request_bytes", "max_n", "max_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
