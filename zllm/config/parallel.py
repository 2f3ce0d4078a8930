"""What tensor and pipeline parallelism ask of a model and of the engine, checked without
torch (the engine arguments run in processes that never import it; executor/parallel/ does
the cut), and which layers each pipeline stage holds."""

from __future__ import annotations

from zllm.config.engine import EngineConfig
from zllm.model.arch_config import ModelArchConfig

# torch.distributed's rendezvous for the executor ranks (tcp://127.0.0.1:port), set in their
# environment by whoever starts them (the supervisor; the offline LLM passes it directly).
TP_INIT_ENV = "ZLLM_TP_INIT"


def indivisible(arch: ModelArchConfig, size: int) -> list[str]:
    """What of the model `size` ranks cannot share evenly (empty: they can). Query heads and
    the MLP split evenly; KV heads too, or each is replicated on size / num_kv_heads ranks."""
    if size == 1:
        return []
    problems = []
    if arch.num_heads % size:
        problems.append(f"{arch.num_heads} attention heads")
    kv = arch.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"{kv} KV heads (need a multiple of the ranks, or ranks a multiple of it)")
    if arch.intermediate_size % size:
        problems.append(f"intermediate size {arch.intermediate_size}")
    if arch.moe is not None:  # (zllm's own MoE families refuse it first, as a capability)
        problems.append("mixture-of-experts layers (not split across ranks yet)")
    return problems


def check_divisible(arch: ModelArchConfig, size: int) -> None:
    """Refuse a rank count the model cannot be split into, saying which would work."""
    problems = indivisible(arch, size)
    if problems:
        fits = [n for n in range(2, 9) if not indivisible(arch, n)]
        raise ValueError(
            f"--tensor-parallel-size {size} does not divide this model's "
            + ", ".join(problems)
            + (f"; sizes that fit: {fits}" if fits else "; no size from 2 to 8 fits it")
        )


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """The decoder layers pipeline stage `stage` holds: consecutive runs, as even as they
    come, the earlier stages taking one more when they do not divide (the last stage also
    computes the logits and samples)."""
    per_stage, extra = divmod(num_layers, num_stages)
    start = stage * per_stage + min(stage, extra)
    return range(start, start + per_stage + (stage < extra))


def check_parallel(config: EngineConfig) -> None:
    """Refuse rank counts the model cannot be split into, and tensor or pipeline parallelism
    with the features they do not cover yet, naming them."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {tp}")
    if pp < 1:
        raise ValueError(f"--pipeline-parallel-size must be at least 1, got {pp}")
    if tp > 1:
        check_divisible(config.arch, tp)
    if config.scheduler.pipeline_stages != pp:  # (EngineArgs sets both; a hand-made config)
        raise ValueError(
            f"scheduler.pipeline_stages {config.scheduler.pipeline_stages} must equal "
            f"pipeline_parallel_size {pp}: the core feeds the stages by it"
        )
    if pp > config.arch.num_layers:
        raise ValueError(
            f"--pipeline-parallel-size {pp} is more than this model's "
            f"{config.arch.num_layers} layers (each stage holds at least one)"
        )
