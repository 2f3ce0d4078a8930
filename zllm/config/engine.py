"""Configuration records shared by every process. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field

from zllm.config.generation import GenerationConfig
from zllm.config.kv_transfer import KVTransferConfig
from zllm.config.media import MediaConfig
from zllm.config.pooler import PoolerConfig
from zllm.config.tenants import TenantLimit, check_tenant_name
from zllm.errors import ParamError
from zllm.model.arch_config import ModelArchConfig
from zllm.protocol import RequestOptions

# On CPU the KV pool gets a fixed budget that leaves room for tests running beside it.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # None: CPU default / GPU utilisation fraction
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Sliding-window layers in their own KV cache groups (zllm/kv/cache_groups.py).
    hybrid_kv_cache: bool = True
    num_blocks: int | None = None  # filled in by the executor once it has sized the pool
    # Prefix pinning: the most KV bytes requests may pin (cache_control); None: a tenth of
    # the pool, 0: pinning off (requests asking for it are served unpinned).
    max_pinned_bytes: int | None = None
    # --kv-cache-dtype: what the KV pool stores ("bfloat16", "float16"); None: the model's
    # dtype (EngineConfig.kv_dtype resolves it).
    kv_cache_dtype: str | None = None


@dataclass(slots=True)
class KVOffloadConfig:
    """KV cache tiers below the pool (core/kv/connector.py, executor/kv/connector.py): a
    cached prefix block evicted from the pool is stored to every tier, and a later request
    whose prefix hashes match loads it back instead of recomputing it. Each tier is LRU
    within its byte bound."""

    cpu_bytes: int = 0  # --kv-offload-bytes: CPU memory (0: no CPU tier)
    disk_dir: str | None = None  # --kv-offload-dir: local disk (None: no disk tier)
    disk_bytes: int = 4 << 30  # --kv-offload-disk-bytes
    # --kv-offload-key-file, resolved (zllm/kv/tier_key.py): authenticates the disk's files.
    key_file: str | None = None

    @property
    def enabled(self) -> bool:
        return self.cpu_bytes > 0 or self.disk_dir is not None


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    # "fcfs": first come, first served; "priority": lower Request.priority first (then
    # arrival), and preemption takes the lowest priority first (vLLM's semantics); "fair":
    # weighted fair share between tenants, priority order within each (core/fair_share.py).
    policy: str = "fcfs"
    # "fair": each tenant's weight (zllm/config/tenants.py names tenants); 1 for one not listed.
    tenant_weights: dict[str, float] = field(default_factory=dict)
    # Tenants' own limits from --tenant-weights' objects: read by the frontend's door
    # (frontend/access/tenant_limits.py), not the scheduler; here because one flag gives both.
    tenant_limits: dict[str, TenantLimit] = field(default_factory=dict)
    # Pipeline stages the executor runs (EngineConfig.pipeline_parallel_size): with more
    # than one, a request is never scheduled while a step of it is in flight (stage 0 needs
    # its last token) and each step takes about 1/stages of the running requests, so the
    # stages' micro-batches overlap (core/scheduler.py).
    pipeline_stages: int = 1
    # A vision model's image encoder tokens one step may start (0: no images, no limit): at
    # least one image's most, so an image always fits a step that starts no other
    # (zllm/config/vision.py encoder_budget).
    max_num_encoder_tokens: int = 0

    @property
    def orders_by_priority(self) -> bool:
        """Whether requests' `priority` values order them (else a non-zero one is refused)."""
        return self.policy in ("priority", "fair")


def check_request_options(options: RequestOptions, config: EngineConfig) -> None:
    """What the engine checks of a request's own options, whoever sent it."""
    if options.lora is not None and config.lora is None:
        raise ParamError("LoRA adapters are not enabled (--enable-lora)", "model")
    check_priority(options.priority, config.scheduler)
    check_tenant_name(options.tenant, "tenant")
    check_cache_salt(options.cache_salt)


# The longest `cache_salt` a request may give (vLLM sets no bound; this one bounds the bytes
# a request carries and hashes).
MAX_CACHE_SALT_CHARS = 1024


def check_cache_salt(salt: str | None) -> None:
    """A request's `cache_salt`: a non-empty string of at most MAX_CACHE_SALT_CHARS."""
    if salt is not None and (
        not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS
    ):
        raise ParamError(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            "cache_salt",
        )


def check_priority(priority: int, config: SchedulerConfig) -> None:
    """A request's `priority` is only taken by a policy that orders by it."""
    if priority and not config.orders_by_priority:
        raise ParamError(
            f"priority needs the priority or fair scheduling policy (--scheduling-policy, "
            f"LLM(scheduling_policy=...)); this engine serves {config.policy}",
            "priority",
        )


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding (`--speculative-config`, vLLM's JSON shape): each step, every
    decoding sequence gets up to `num_speculative_tokens` proposed tokens, verified by the
    target model in one forward (executor/spec_decode/)."""

    method: str  # "ngram" (prompt lookup) or "draft_model"
    num_speculative_tokens: int
    # ngram: the longest and shortest suffix n-gram looked up in the sequence so far.
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    # draft_model: what the user named and the resolved path, and its architecture.
    model: str | None = None
    draft_model_path: str | None = None
    draft_arch: ModelArchConfig | None = None
    # Steps with more running sequences than this propose nothing (vLLM's
    # disable_by_batch_size): under load a step is compute-bound and verification costs more
    # than it saves. None: always speculate.
    disable_by_batch_size: int | None = None

    @property
    def lookahead_slots(self) -> int:
        """KV slots a sequence needs past its step's tokens: a draft model writes its
        proposals' keys and values there (ngram proposes without a forward)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


@dataclass(slots=True)
class LoRAConfig:
    """LoRA adapters (`--enable-lora`): requests name adapters that the executor applies
    beside the base model's matmuls, several adapters in one step (executor/lora/)."""

    # The most distinct adapters one step's batch may hold (the scheduler keeps a request
    # of another adapter waiting beyond it).
    max_loras: int = 1
    # The largest rank an adapter may have (a larger one is refused at load).
    max_lora_rank: int = 16


@dataclass(slots=True)
class EngineConfig:
    model: str  # what the user asked for: a path or a short name
    model_path: str  # the resolved file or directory
    arch: ModelArchConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    # None: "gguf" for a GGUF file on CPU when the kernel can serve it ("gguf-float" under
    # --deterministic), else fp32 ("none"). "gguf": matmuls on the file's quantized blocks,
    # each type with its fastest arithmetic on this CPU; "gguf-float": the float kernel
    # always; "gguf-int8": integer dots wherever a type has them
    # (executor/weights/gguf_arithmetic.py); "int8": a plain checkpoint's decoder matmuls
    # rounded to Q8_0 blocks at load (CPU; executor/weights/quantization.py).
    quantization: str | None = None
    enforce_eager: bool = False  # GPU: no CUDA graphs
    # GPU: prefill and mixed steps replay graphs in pieces between attention calls too
    # (executor/graphs/piecewise.py; --cudagraph-mode full_and_piecewise).
    piecewise_cuda_graphs: bool = False
    # Launch step N+1 before step N's tokens reach the host (executor/async_steps.py).
    async_executor: bool = False
    # "auto": weights from the model's files; "dummy": random weights, no weight file read.
    load_format: str = "auto"
    # Whose model code runs: "zllm" (executor/models/) or "transformers" (the transformers
    # backend); EngineArgs resolves --model-impl auto to one of them (zllm/model/impl.py).
    model_impl: str = "zllm"
    # Embeddings: how the prompt's final hidden states are pooled, normalised and prefixed
    # (zllm/config/pooler.py: sentence-transformers' files, --pooling, --pooler-config).
    pooler: PoolerConfig = field(default_factory=PoolerConfig)
    # "generate", or "pooling": an embedding model, which answers embeddings requests only
    # (zllm/config/pooler.py runner_of; tokenizer_proc/request_tokenizer.py refuses the rest).
    runner: str = "generate"
    # The generation_config.json read at startup (its eos ids are merged into arch's).
    generation_config: GenerationConfig = field(default_factory=GenerationConfig)
    speculative: SpeculativeConfig | None = None
    kv_offload: KVOffloadConfig | None = None  # None: no tiers below the KV pool
    media: MediaConfig = field(default_factory=MediaConfig)  # images in (zllm/media/)
    # Batch-invariant execution (executor/kernels/batch_invariant.py): a request's logprobs do not
    # depend on its batch, chunking, prefix hits or preemptions. CPU only.
    deterministic: bool = False
    lora: LoRAConfig | None = None  # None: LoRA off (--enable-lora turns it on)
    # Sleep mode: LLM.sleep(level)/wake_up(tags), POST /sleep and /wake_up may release the KV
    # pool (level 1) or the weights too (level 2) while idle.
    enable_sleep_mode: bool = False
    # Ranks the model is split over (executor/parallel/): each an executor process.
    # tensor_parallel_size ranks per pipeline stage, pipeline_parallel_size stages:
    # rank = stage * tensor_parallel_size + tensor-parallel rank.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Where the ranks run: "mp", executor processes the supervisor starts on this host; "ray",
    # Ray actors placed on a Ray cluster's nodes with ray_placement_strategy (one executor
    # process drives them: executor/ranks/ray_actors.py).
    distributed_executor_backend: str = "mp"
    ray_placement_strategy: str = "PACK"
    # Prefill/decode disaggregation (--kv-transfer-config; zllm/config/kv_transfer.py).
    kv_transfer: KVTransferConfig | None = None
    # Where every process reads the tokenizer and chat template: --tokenizer resolved, else
    # (left empty) the model's own files.
    tokenizer_path: str = ""

    def __post_init__(self) -> None:
        if not self.tokenizer_path:
            self.tokenizer_path = self.model_path

    @property
    def kv_dtype(self) -> str:
        """The dtype the KV pool stores (and the tiers and transfers move): --kv-cache-dtype,
        else the model's."""
        return self.cache.kv_cache_dtype or self.dtype

    @property
    def world_size(self) -> int:
        """Executor ranks in all."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_processes(self) -> int:
        """The executor processes the supervisor starts: one per rank, or the Ray driver."""
        return 1 if self.distributed_executor_backend == "ray" else self.world_size


def sleep_refusal(config: EngineConfig, offline: bool = False) -> str | None:
    """Why sleep mode's calls (sleep, wake_up) are refused, None when they may run: only an
    engine started with sleep mode releases and restores its memory. The one rule: the
    server's routes (and /openapi.json, which lists them only then), its cores and the
    offline LLM all ask it; `offline` words the refusal for `LLM(...)`."""
    if config.enable_sleep_mode:
        return None
    if offline:
        return "sleep needs LLM(..., enable_sleep_mode=True)"
    return "sleep mode is off (start the server with --enable-sleep-mode)"
