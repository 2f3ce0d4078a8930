"""zllm: an LLM inference and serving engine (paged KV cache, continuous batching)."""

from zllm.lora import LoRARequest
from zllm.outputs import BeamSearchOutput, CompletionOutput, Logprob, RequestOutput
from zllm.pooling_params import PoolingParams
from zllm.sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "PoolingParams",
    "RequestOutput",
    "BeamSearchOutput",
    "CompletionOutput",
    "Logprob",
    "LoRARequest",
    "__version__",
]


def __getattr__(name: str):
    # `LLM` pulls in the executor (torch); import it only when asked for.
    if name == "LLM":
        from zllm.llm import LLM

        return LLM
    raise AttributeError(f"module 'zllm' has no attribute {name!r}")
