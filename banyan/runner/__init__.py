"""The model runner: ForwardBatch in, logits out."""

from banyan.runner.model_runner import ModelRunner, StepInputs

__all__ = ["ModelRunner", "StepInputs"]
