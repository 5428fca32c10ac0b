from banyan.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
