"""Vision-language models with images on a real GPU; part of the GPU run (`pytest
tests/test_cuda*.py`). The tiny random Qwen2.5-VL and Gemma 3 vision models of
tests/test_qwen_vl.py and tests/test_gemma3_vision.py (their tokenizers come from the SmolLM2
and Gemma 3 packages: carry them to the GPU machine in parts, benchmarks/gpu_env.sh), in fp32
on the GPU: the image encoder on the device, Gemma 3's language model on the torch attention
backend (its image masks), Qwen2.5-VL's on the CUDA kernels with decode graphs, greedy
tokens as the CPU engine's on the same image prompts (a flip only at a near-tie)."""

from __future__ import annotations

import importlib.util
import io

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
if importlib.util.find_spec("cupy") is None:
    pytest.skip("CuPy is not installed: pip install zllm[cuda]", allow_module_level=True)

from gpu_parity import assert_same_greedy, free_llm  # noqa: E402
from PIL import Image  # noqa: E402
from qwen_vl_reference import MARK as QWEN_MARK  # noqa: E402
from qwen_vl_reference import images as qwen_images  # noqa: E402
from vision_models import (  # noqa: E402
    QWEN_VL_TEXT,
    png,
    write_tiny_gemma3_vlm,
    write_tiny_qwen_vl,
)

from zllm import LLM, SamplingParams  # noqa: E402

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
GEMMA_MARK = "<start_of_image>"


def gemma_images(*seeds: int) -> list[Image.Image]:
    """As tests/test_gemma3_vision.py draws them."""
    return [Image.open(io.BytesIO(png(seed, (40 + 8 * seed, 30)))) for seed in seeds]


# Heads of 64 (the CUDA kernels' smallest), M-RoPE sections over its 32 frequencies.
QWEN_VL_TEXT_64 = dict(
    QWEN_VL_TEXT, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
    rope_parameters={"rope_type": "default", "rope_theta": 100.0, "mrope_section": [8, 12, 12]},
)  # fmt: skip


def model_and_prompts(which: str, tmp_path, request) -> tuple[str, list[dict]]:
    if which == "qwen2_5_vl":
        smollm2 = request.getfixturevalue("smollm2_path")
        path = write_tiny_qwen_vl(tmp_path / which, smollm2, text=QWEN_VL_TEXT_64)
        mark, images = QWEN_MARK, qwen_images
    else:
        gguf = request.getfixturevalue("gemma3_path")
        path = write_tiny_gemma3_vlm(tmp_path / which, gemma3_gguf=gguf)
        mark, images = GEMMA_MARK, gemma_images
    prompts = [
        {"prompt": f"Describe {mark} and then {mark} briefly", "multi_modal_data": {"image": images(0, 1)}},
        {"prompt": f"{mark} what is it", "multi_modal_data": {"image": images(2)}},
        {"prompt": f"again {mark}", "multi_modal_data": {"image": images(0)}},
    ]  # fmt: skip
    return str(path), prompts


@pytest.mark.parametrize("which", ["qwen2_5_vl", "gemma3"])
def test_images_on_the_gpu_answer_as_on_cpu(which, tmp_path, request):
    path, prompts = model_and_prompts(which, tmp_path, request)
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(path, device=device, dtype="float32", kv_cache_memory_bytes=64 << 20)
        outs[device] = llm.generate(prompts, PARAMS, use_tqdm=False)
        if device == "cuda":
            host = llm.model_runner.host
            # Gemma 3's image masks need the torch backend; Qwen2.5-VL's causal image tokens
            # take the CUDA kernels and its decode steps replay graphs.
            expected = "torch" if which == "gemma3" else "cuda"
            assert host.layout.attention.name == expected
            assert (host.decode.graph_runner is not None) == (which == "qwen2_5_vl")
            assert next(host.images.encoder.encoder.parameters()).is_cuda
        free_llm(llm)
    assert assert_same_greedy(outs["cuda"], outs["cpu"], which) <= 1
