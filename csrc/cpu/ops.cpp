// zllm's CPU kernels as one torch extension (one translation unit: torch's headers dominate
// the build time, so they are parsed once). Loaded by executor/cpu_kernels.py.

#include <torch/extension.h>

#include "gguf_int8.h"
#include "gguf_linear.h"
#include "paged_attention.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_linear", &gguf_linear, "x @ dequant(qweight)^T for GGUF block-quantized weights");
  m.def("gguf_linear_into", &gguf_linear_into,
        "x @ dequant(qweight)^T written into y (rows may be strided)");
  m.def("gguf_linear_int8", &gguf_linear_int8,
        "x quantized to int8 per 32 values @ GGUF weights, integer dot products");
  m.def("gguf_linear_int8_into", &gguf_linear_int8_into, "gguf_linear_int8 written into y");
  m.def("gguf_dequantize", &gguf_dequantize, "GGUF blocks -> fp32 rows");
  m.def("paged_decode_attention", &paged_decode_attention,
        "one-token-per-sequence attention read from the paged KV cache");
}
