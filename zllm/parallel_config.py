"""What tensor parallelism asks of a model and of the engine, checked without torch (the
engine arguments run in processes that never import it; executor/parallel.py does the cut)."""

from __future__ import annotations

from zllm.config import EngineConfig, ModelArchConfig

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


def check_tensor_parallel(config: EngineConfig) -> None:
    """Refuse tensor parallelism with the features it does not cover yet, naming them."""
    size = config.tensor_parallel_size
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {size}")
    if size == 1:
        return
    check_divisible(config.arch, size)
    unsupported = [
        (config.model_impl != "zllm", "--model-impl transformers"),
        (config.lora is not None, "--enable-lora"),
        (config.speculative is not None, "--speculative-config"),
        (config.kv_offload is not None, "KV offload (--kv-offload-bytes / --kv-offload-dir)"),
        (config.enable_sleep_mode, "--enable-sleep-mode"),
    ]
    named = [name for refused, name in unsupported if refused]
    if named:
        raise ValueError(
            f"--tensor-parallel-size {size} does not support {', '.join(named)} yet: "
            "use one rank with it, or leave it out"
        )
