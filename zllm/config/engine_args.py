"""From what the user typed (a model name and vLLM-named options) to an `EngineConfig`.

`EngineArgs` is the one place an engine option is declared: its fields are the keywords of
`LLM(model, **kwargs)` and, through `zllm.config.arg_utils`, the flags of `zllm serve`, `generate`
and `bench`, with their help. A new option is one field here (plus its use in
`create_engine_config`).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from zllm.config import media
from zllm.config.arg_utils import (
    add_dataclass_args,
    check_choices,
    dataclass_from_args,
    format_size,
    option,
    parse_json_object,
    parse_size,
    positive_float,
    positive_int,
    unit_fraction,
)
from zllm.config.capabilities import check_capabilities
from zllm.config.engine import (
    CacheConfig,
    EngineConfig,
    KVOffloadConfig,
    LoRAConfig,
    SchedulerConfig,
)
from zllm.config.generation import (
    log_generation_config,
    merge_eos_token_ids,
    read_generation_config,
)
from zllm.config.kv_layout import block_bytes, check_moves_whole_blocks, fit_state_slots
from zllm.config.kv_transfer import KVTransferConfig, check_ports, kv_transfer_config_from
from zllm.config.parallel import check_parallel
from zllm.config.pooler import (
    RUNNERS,
    check_encoder,
    classifier_from_tokens,
    context_length,
    pooler_config_of,
    runner_of,
)
from zllm.config.quantization import QUANTIZATION_CHOICES, check_quantization, deterministic_refusal
from zllm.config.speculative import speculative_config_from
from zllm.config.tenants import (
    TenantPolicy,
    parse_tenant_weights,
    tenant_limits_of,
    tenant_weights_of,
)
from zllm.config.vision import check_vision, set_encoder_budget, tokens_per_image
from zllm.kv.kv_dtypes import KV_CACHE_DTYPES, kv_cache_dtype_of
from zllm.kv.tier_key import resolve_key_file
from zllm.model.arch import read_model_arch
from zllm.model.files import resolve_model, resolve_tokenizer
from zllm.model.impl import MODEL_IMPLS, choose_model_impl

logger = logging.getLogger(__name__)

MODEL_HELP = "short name, .gguf file, HF directory or Hub id (org/name, org/name:Q4_K_M)"


@dataclass(slots=True)
class EngineArgs:
    # Not a generated flag: `serve` takes it positionally, `generate` and `bench` as --model.
    model: str | None = None
    # Hub ids (zllm/model/hub.py): vLLM's names.
    revision: str | None = option(
        None, help="a Hub id's branch, tag or commit hash (default: its main branch)"
    )
    download_dir: str | None = option(
        None,
        help="the Hugging Face cache Hub ids are fetched into and read from (default "
        "$HF_HUB_CACHE, ~/.cache/huggingface/hub)",
    )
    tokenizer: str | None = option(
        None,
        help="a tokenizer (and chat template) to use instead of the model's: a directory with "
        "tokenizer.json, a .gguf file or a Hub id",
    )
    tokenizer_revision: str | None = option(
        None, help="--tokenizer's Hub revision (default: its main branch)"
    )
    max_model_len: int | None = option(
        None, help="longest prompt + output a request may have (default: the model's context)"
    )
    max_num_seqs: int = option(256, help="most sequences in one step")
    max_num_batched_tokens: int = option(
        2048, help="most tokens one step computes, over all its sequences"
    )
    enable_chunked_prefill: bool = option(
        True, help="prefill a long prompt over several steps, beside other requests' decodes"
    )
    scheduling_policy: str = option(
        "fcfs",
        help="fcfs: first come, first served; priority: requests with a lower `priority` "
        "value first (then by arrival), and preemption takes the lowest priority first; "
        "fair: weighted fair share between tenants (API key, else X-Tenant header), so one "
        "tenant flooding the queue cannot starve the others, priority order within a tenant",
        choices=("fcfs", "priority", "fair"),
    )
    tenant_weights: dict[str, float | TenantPolicy] | None = option(
        None,
        help="--scheduling-policy fair: each tenant's share of the engine, as name=weight "
        "pairs (key-1=3,alice=1.5) or a JSON object; a tenant not listed weighs 1; the "
        "tenant of the N-th --api-key is key-N. A JSON value may be an object that also "
        'gives the tenant\'s own limits ({"key-1": {"weight": 3, "max_concurrency": 4, '
        '"max_requests_per_second": 10}}), replacing --tenant-max-concurrency and '
        "--tenant-max-requests-per-second for it; limits alone need no fair policy",
        parse=parse_tenant_weights,
    )
    block_size: int = option(16, help="tokens per KV cache block")
    kv_cache_memory_bytes: int | None = option(
        None,
        help="KV cache budget in bytes (suffixes K/M/G), per executor rank; default 1 GiB on "
        "CPU, on GPU what --gpu-memory-utilization leaves",
        parse=parse_size,
    )
    gpu_memory_utilization: float = option(
        0.9,
        help="GPU: the share of the GPU's total memory this engine may hold (weights, the "
        "largest step's activations, the KV cache: vLLM's meaning); the KV cache never takes "
        "more than is free after the load",
        parse=unit_fraction,
    )
    num_gpu_blocks_override: int | None = option(
        None, help="this many KV cache blocks, whatever the memory budget (for tests)"
    )
    enable_prefix_caching: bool = option(
        True, help="reuse the KV blocks of prompt prefixes computed before"
    )
    kv_offload_bytes: int = option(
        0,
        help="KV offload: a CPU-memory tier of this many bytes below the KV pool (suffixes "
        "K/M/G): cached prefix blocks evicted from the pool are kept there (LRU) and loaded "
        "back for a later request with that prefix instead of being recomputed; 0: none. "
        "Counted in whole blocks: with tensor-parallel ranks each keeps its part of them",
        parse=parse_size,
    )
    kv_offload_dir: str | None = option(
        None,
        help="KV offload: a local-disk tier in this directory (a subdirectory per model "
        "layout; it survives restarts), below the CPU tier if both are set",
    )
    kv_offload_key_file: str | None = option(
        None,
        help="KV offload: the secret that authenticates the disk tier's files (an HMAC of "
        "each), kept outside --kv-offload-dir; default $ZLLM_CACHE/kv-offload.key, made at "
        "first start with owner-only permissions",
    )
    kv_offload_disk_bytes: int = option(
        4 << 30,
        help="KV offload: the disk tier's bound in bytes (LRU), in whole blocks as "
        "--kv-offload-bytes",
        parse=parse_size,
    )
    max_pinned_bytes: int | None = option(
        None,
        help="prefix pinning: the most KV cache bytes requests may pin with cache_control "
        "(suffixes K/M/G); default a tenth of the KV pool; 0 serves such requests unpinned",
        parse=parse_size,
    )
    hybrid_kv_cache: bool = option(
        True,
        help="models mixing sliding-window and full layers: the sliding layers get their own "
        "block tables, which free blocks that fall out of the window (vLLM's hybrid KV cache "
        "manager); --no-hybrid-kv-cache keeps every block of every layer",
    )
    seed: int = option(0, help="seed of the random state of requests that set no seed")
    dtype: str = option(
        "auto",
        help="weights and activations; auto: float32 on CPU, bfloat16 on GPU",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    device: str = option("auto", help="cpu, cuda or cuda:N; auto: cuda when a GPU is visible")
    kv_cache_dtype: str = option(
        "auto",
        help="what the KV cache stores: auto (the model's dtype), bf16 or fp16 (half the bytes "
        "of fp32 KV on CPU: twice the tokens fit, long contexts decode faster; attention reads "
        "them widened to fp32; bfloat16 / float16 are the same), int8 (a quarter of the bytes "
        "plus a scale per token and head; CPU)",
        choices=KV_CACHE_DTYPES,
    )
    quantization: str | None = option(
        None,
        help="GGUF files on CPU: gguf (the default): matmuls read the file's quantized "
        "blocks with the fastest arithmetic this CPU has for each type: integer dots on "
        "activations rounded to int8 per block (llama.cpp's arithmetic) for the K-quants, the "
        "float kernel elsewhere (docs/models.md, Matmuls on CPU); gguf-float: the same "
        "blocks, always the float kernel: the file's exact weights in fp32 arithmetic, as "
        "transformers computes; "
        "gguf-int8: integer dots wherever a type has them. none: fp32 matmuls; int8: int8 "
        "weights with dynamic int8 activations (CPU; opt-in, see BENCHMARKS.md). "
        "compressed-tensors, gptq, awq, fp8: a quantized checkpoint's method, read from its "
        "config.json (the default for one; docs/models.md, Quantized checkpoints)",
        choices=QUANTIZATION_CHOICES,
    )
    load_format: str = option(
        "auto",
        help="auto: the model's weights from its files; dummy: random weights of the model's "
        "shapes, no weight files read (a directory with config.json and a tokenizer is "
        "enough): benchmarks of any architecture and size",
        choices=("auto", "dummy"),
    )
    enforce_eager: bool = option(False, help="GPU: run eagerly, no CUDA graphs")
    cudagraph_mode: str = option(
        "full_decode_only",
        help="GPU: which steps replay CUDA graphs. full_decode_only: decode-only steps, one "
        "graph each; full_and_piecewise: those, and prefill and mixed steps of up to 512 "
        "tokens in pieces between the attention calls, which run eagerly (vLLM's modes; "
        "opt-in until measured on a GPU)",
        choices=("full_decode_only", "full_and_piecewise"),
    )
    async_executor: str = option(
        "auto",
        help="launch each step before the last one's sampled tokens reach the host, so the "
        "executor's Python overlaps the GPU's kernels (tokens feed the next step on the "
        "device); auto: on for CUDA, off on CPU (whose kernels run on the calling thread). "
        "One rank, no speculative decoding; steps whose sampling reads the output on the host "
        "(penalties, grammars, ...) run one at a time",
        choices=("auto", "on", "off"),
    )
    pooling: str | None = option(
        None,
        help="embeddings (/v1/embeddings, LLM.embed): pool the prompt's final hidden states "
        "by their mean, the last token's or the first (cls); default: the model's "
        "sentence-transformers Pooling module, else mean",
        choices=("mean", "last", "cls"),
    )
    pooler_config: str | None = option(
        None,
        help='embeddings: vLLM\'s JSON, e.g. \'{"pooling_type": "LAST", "normalize": false}\', '
        "over what the model's sentence-transformers files say (docs/embeddings.md)",
    )
    runner: str = option(
        "auto",
        help="generate, or pooling (an embedding model or a classifier: the pooling routes "
        "only, /v1/embeddings, /classify, /score, /rerank; generation routes answer 400); auto: "
        "pooling for a checkpoint without a language-model head or whose config names base "
        "model classes only, else generate",
        choices=RUNNERS,
    )
    model_impl: str = option(
        "auto",
        help="whose model code runs: zllm (native, fastest), transformers (transformers' "
        "modeling code with zllm's paged attention: any decoder-only causal LM whose "
        "transformers class supports attention backends), auto (zllm's when it has the "
        "architecture, else transformers')",
        choices=MODEL_IMPLS,
    )
    hf_overrides: dict | None = option(
        None,
        help="vLLM's, for a causal LM as a classifier: '{\"architectures\": "
        '["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
        "\"is_original_qwen3_reranker\": true}' scores by those tokens' logits (docs/embeddings.md)",
        parse=parse_json_object,
    )
    speculative_config: dict | None = option(
        None,
        help="speculative decoding, as a JSON object in vLLM's shape: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, '
        '"prompt_lookup_min": 2}\' proposes the continuation of the last earlier occurrence of '
        "the sequence's final n-gram; "
        '\'{"method": "draft_model", "model": M, "num_speculative_tokens": 4}\' runs a '
        "smaller model with the same tokenizer; optional disable_by_batch_size: N stops "
        "proposing while more than N sequences run",
        parse=parse_json_object,
    )
    deterministic: bool = option(
        False,
        help="batch-invariant execution (CPU): a request's logprobs are bitwise the same "
        "alone or in any batch, under any prefill chunking, with prefix-cache hits and after "
        "preemption (fixed-shape matmul tiles, every query attends as a decode row); costs "
        "throughput, see BENCHMARKS.md",
    )
    enable_lora: bool = option(
        False,
        help="serve LoRA adapters (PEFT format) beside the base model: requests name one as "
        "their model (--lora-modules, POST /v1/load_lora_adapter; offline: lora_request=)",
    )
    max_loras: int = option(
        1, help="LoRA: the most distinct adapters in one step's batch", parse=positive_int
    )
    max_lora_rank: int = option(
        16, help="LoRA: the largest adapter rank accepted", parse=positive_int
    )
    tensor_parallel_size: int = option(
        1,
        help="split the model over this many executor processes (tensor parallelism: heads, "
        "MLP and vocabulary split, an all-reduce per layer half; gloo on CPU, NCCL on GPUs)",
        parse=positive_int,
    )
    pipeline_parallel_size: int = option(
        1,
        help="split the model's layers into this many pipeline stages, each its own executor "
        "process(es) (x --tensor-parallel-size); the stages pass activations on and work on "
        "different micro-batches at once",
        parse=positive_int,
    )
    distributed_executor_backend: str = option(
        "mp",
        help="where the executor's ranks run: mp, processes on this host; ray, Ray actors on "
        "the nodes of a Ray cluster (RAY_ADDRESS, else one running here, else a local one; "
        "with --data-parallel-size, RAY_ADDRESS else a head node the server starts, shared "
        "by every engine; pip install 'zllm[ray]')",
        choices=("mp", "ray"),
    )
    ray_placement_strategy: str = option(
        "PACK",
        help="with --distributed-executor-backend ray: how the ranks' bundles (one CPU or GPU "
        "each) are placed on the cluster's nodes (Ray placement group strategies)",
        choices=("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"),
    )
    kv_transfer_config: dict | None = option(
        None,
        help="prefill/decode disaggregation, as JSON in vLLM's shape: "
        '\'{"kv_connector": "ZllmConnector", "kv_role": "kv_producer"|"kv_consumer", '
        '"kv_ip": "127.0.0.1", "kv_port": 14579}\' (a producer sends the prompt KV of requests '
        "marked do_remote_decode to the consumer at kv_ip:kv_port; see zllm proxy)",
        parse=parse_json_object,
    )
    enable_sleep_mode: bool = option(
        False,
        help="allow releasing the KV cache (level 1; the weights stay in host memory) or the "
        "weights too (level 2, reloaded from the model file on waking) while idle: POST "
        "/sleep?level=1|2 and /wake_up[?tags=weights|kv_cache] (LLM.sleep() / wake_up())",
    )
    generation_config: str = option(
        "auto",
        help="auto: the model directory's generation_config.json sets the defaults of "
        "temperature, top_p, top_k, min_p, repetition_penalty and max_tokens (its "
        "max_new_tokens) for requests that leave them unset, and its eos_token_id ids stop "
        "generation too; vllm: zllm's own defaults (the eos ids still stop); a directory: "
        "read its generation_config.json instead",
    )

    # Images in (zllm/config/media.py, docs/images.md).
    limit_mm_per_prompt: dict | None = option(
        None,
        help="most images one prompt may hold, JSON as vLLM's: '{\"image\": 2}' (default 8)",
        parse=media.parse_limit_mm_per_prompt,
    )
    max_image_pixels: int = option(
        media.DEFAULT_MAX_IMAGE_PIXELS,
        help="largest image (width x height), read from its header before decoding",
        parse=positive_int,
    )
    max_image_bytes: int = option(
        media.DEFAULT_MAX_IMAGE_BYTES,
        help="largest encoded image sent or fetched (suffixes K/M/G)",
        parse=parse_size,
        show_default=format_size,
    )
    allowed_media_domains: list[str] = option(
        default_factory=list,
        help="hosts whose http(s) image URLs are fetched (comma-separated; default none)",
        parse=media.parse_domains,
        action="extend",
    )
    allowed_local_media_path: str | None = option(
        None, help="a directory whose files file:// image URLs may name (default none)"
    )
    media_fetch_timeout: float = option(
        media.DEFAULT_FETCH_TIMEOUT_S,
        help="seconds an image URL's fetch may take",
        parse=positive_float,
    )

    def create_engine_config(self) -> EngineConfig:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}."
            )
        check_choices(self)
        model_path = resolve_model(self.model, self.revision, self.download_dir)
        tokenizer_path = self._tokenizer_path(model_path)
        impl = choose_model_impl(model_path, self.model_impl)
        arch = classifier_from_tokens(
            read_model_arch(model_path, impl), self.hf_overrides, tokenizer_path
        )
        logger.info("Model %s (%s): %s", model_path, impl.architecture, impl.reason)
        device = ("cuda" if _cuda_available() else "cpu") if self.device == "auto" else self.device
        if arch.chunked_layers and device.startswith("cuda"):
            arch.within_one_chunk()  # (the CUDA kernels take a window, not a chunk)
        max_model_len = context_length(model_path, arch)  # (a sentence-transformers model's)
        if self.max_model_len is not None:
            if not 1 < self.max_model_len <= arch.max_position_embeddings:
                why = arch.context_cap or "the model's context length"
                raise ValueError(
                    f"max_model_len must be in [2, {arch.max_position_embeddings}] "
                    f"({why}), got {self.max_model_len}."
                )
            max_model_len = self.max_model_len
        generation = read_generation_config(model_path, self.generation_config, arch.vocab_size)
        # One list of ids that end generation: the model files' and generation_config's.
        arch.eos_token_ids = merge_eos_token_ids(arch.eos_token_ids, generation.eos_token_ids)
        log_generation_config(generation, self.generation_config, arch.eos_token_ids)
        dtype = self.dtype
        if dtype == "auto":
            # bf16 is emulated on most CPUs, so fp32 is both the reference and the fast path there.
            dtype = "bfloat16" if device.startswith("cuda") else "float32"
        config = EngineConfig(
            model=self.model or "smollm2",
            model_path=model_path,
            tokenizer_path=tokenizer_path,
            arch=arch,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                hybrid_kv_cache=self.hybrid_kv_cache,
                num_blocks=self.num_gpu_blocks_override,
                max_pinned_bytes=self.max_pinned_bytes,
                kv_cache_dtype=kv_cache_dtype_of(self.kv_cache_dtype, dtype, device),
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
                tenant_weights=tenant_weights_of(self.tenant_weights, self.scheduling_policy),
                tenant_limits=tenant_limits_of(self.tenant_weights),
                pipeline_stages=self.pipeline_parallel_size,
            ),
            seed=self.seed,
            dtype=dtype,
            device=device,
            quantization=self._check_quantization(device, model_path, impl.name),
            enforce_eager=self.enforce_eager,
            piecewise_cuda_graphs=self.cudagraph_mode == "full_and_piecewise",
            async_executor=self._async_executor(device),
            load_format=self.load_format,
            model_impl=impl.name,
            pooler=pooler_config_of(model_path, self.pooler_config, self.pooling, arch),
            runner=runner_of(self.runner, model_path, arch),
            generation_config=generation,
            speculative=speculative_config_from(self.speculative_config, arch),
            deterministic=self._check_deterministic(device),
            lora=self._lora_config(),
            enable_sleep_mode=self.enable_sleep_mode,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=self._check_backend(),
            ray_placement_strategy=self.ray_placement_strategy,
        )
        config.media = media.media_config_of(
            self.limit_mm_per_prompt, self.max_image_pixels, self.max_image_bytes,
            self.allowed_media_domains, self.allowed_local_media_path, self.media_fetch_timeout,
        )  # fmt: skip
        config.kv_offload = self._kv_offload_config(config)
        config.kv_transfer = self._kv_transfer_config(config)
        check_capabilities(config)
        fit_state_slots(config)
        check_parallel(config)
        check_vision(config, tokens_per_image(model_path, arch))
        set_encoder_budget(config)
        check_encoder(config)
        return config

    def _tokenizer_path(self, model_path: str) -> str:
        if self.tokenizer is None:
            if self.tokenizer_revision is not None:
                raise ValueError("tokenizer_revision is the revision of --tokenizer; none given")
            return model_path
        return resolve_tokenizer(self.tokenizer, self.tokenizer_revision, self.download_dir)

    def _kv_offload_config(self, config: EngineConfig) -> KVOffloadConfig | None:
        offload = KVOffloadConfig(
            cpu_bytes=self.kv_offload_bytes,
            disk_dir=self.kv_offload_dir,
            disk_bytes=self.kv_offload_disk_bytes,
        )
        if not offload.enabled:
            return None
        if offload.disk_dir is not None:
            offload.key_file = resolve_key_file(offload.disk_dir, self.kv_offload_key_file)
        what = "--kv-offload-dir" if offload.disk_dir is not None else "KV offload"
        check_moves_whole_blocks(config, what)
        per_block = block_bytes(config)
        for name, size in (("--kv-offload-bytes", offload.cpu_bytes),
                           ("--kv-offload-disk-bytes", offload.disk_bytes)):  # fmt: skip
            if size and size < per_block:
                raise ValueError(f"{name} {size} holds no KV block ({per_block} bytes)")
        return offload

    def _check_backend(self) -> str:
        if self.distributed_executor_backend == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise ValueError(
                    "--distributed-executor-backend ray needs Ray: pip install 'zllm[ray]'"
                )
        return self.distributed_executor_backend

    def _kv_transfer_config(self, config: EngineConfig) -> KVTransferConfig | None:
        """--kv-transfer-config, checked against what disaggregation needs: whole blocks
        named by prefix-cache hashes (each KV cache group's under its own key)."""
        transfer = kv_transfer_config_from(self.kv_transfer_config)
        if transfer is None:
            return None
        check_moves_whole_blocks(config, "--kv-transfer-config")
        check_ports(transfer, config.world_size, transfer.consumer_engines)
        if transfer.consumes and transfer.buffer_bytes < block_bytes(config):
            raise ValueError(
                f"kv_buffer_size {transfer.buffer_bytes} holds no KV block "
                f"({block_bytes(config)} bytes)"
            )
        return transfer

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be positive")
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank)

    def _check_quantization(self, device: str, model_path: str, impl: str) -> str | None:
        return check_quantization(
            self.quantization,
            device=device,
            model_path=model_path,
            load_format=self.load_format,
            model_impl=impl,
            tensor_parallel_size=self.tensor_parallel_size,
        )

    def _async_executor(self, device: str) -> bool:
        if self.async_executor == "off":
            return False
        if self.async_executor == "auto":
            return (
                device.startswith("cuda")
                and self.tensor_parallel_size * self.pipeline_parallel_size == 1
                and not self.speculative_config
            )
        if self.speculative_config:
            raise ValueError(
                "--async-executor on cannot run with speculative decoding: the next step's "
                "proposals are made from this step's tokens, which it would not wait for"
            )
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError(
                "--async-executor on runs one executor rank: with several ranks a step's "
                "tokens are settled by the ranks together (pipeline stages already overlap "
                "steps, one per stage)"
            )
        return True

    def _check_deterministic(self, device: str) -> bool:
        if not self.deterministic:
            return False
        if device != "cpu":
            raise ValueError(
                "deterministic (batch-invariant) execution is CPU-only; the CUDA path is not "
                "batch-invariant (see BENCHMARKS.md)"
            )
        refusal = deterministic_refusal(self.quantization)
        if refusal is not None:
            raise ValueError(refusal)
        return True


def add_engine_args(parser: argparse.ArgumentParser, *, model_positional: bool = False) -> None:
    """The model (`zllm serve MODEL`, or `--model MODEL`) and a flag per engine option."""
    if model_positional:
        parser.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    else:
        parser.add_argument("--model", default=None, help=MODEL_HELP)
    add_dataclass_args(parser, EngineArgs, title="engine options")


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """The `EngineArgs` that flags added by `add_engine_args` spell."""
    return dataclass_from_args(EngineArgs, args)


def _cuda_available() -> bool:
    """Whether a CUDA device is visible, without importing torch into this process."""
    import os

    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")
