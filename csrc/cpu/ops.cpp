// zllm's CPU kernels as one Python module: the bindings. Each kernel is compiled in its own
// translation unit (ops.h names them), in parallel and without pybind11; this one alone parses
// torch's pybind11 casters. Built by executor/kernels/cpu_build.py, loaded by
// executor/kernels/cpu.py.

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "cpu_isa.h"
#include "decode_stack.h"
#include "ops.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dense_linear", &dense_linear,
        "x @ w^T (+ bias) for fp32 w: the AVX-512 few-rows kernel at 1-8 rows, else torch's");
  m.def("gguf_linear", &gguf_linear, "x @ dequant(qweight)^T for GGUF block-quantized weights");
  m.def("gguf_linear_into", &gguf_linear_into,
        "x @ dequant(qweight)^T written into y (rows may be strided)");
  m.def("gguf_linear_int8", &gguf_linear_int8,
        "x quantized to int8 per 32 values @ GGUF weights, integer dot products");
  m.def("gguf_linear_int8_into", &gguf_linear_int8_into, "gguf_linear_int8 written into y");
  m.def("gguf_linear_bf16_into", &gguf_linear_bf16_into,
        "bf16 x @ GGUF weights dequantized to bf16 a panel at a time, torch's bf16 GEMM, into y");
  m.def("moe_experts_linear", &moe_experts_linear,
        "one projection of a MoE layer's chosen experts in one parallel region (moe_experts.h)");
  m.def(
      "cpu_isa", [] { return std::string(zllm_isa::isa_name(zllm_isa::isa_choice().load())); },
      "the instruction set the kernels with an AVX-512 variant use now: avx512vnni or avx2");
  m.def(
      "set_cpu_isa",
      [](const std::string& name) {
        int isa = zllm_isa::kAvx2;
        TORCH_CHECK(zllm_isa::isa_from_name(name, &isa), "CPU ISA '", name,
                    "': expected auto, avx2 or (on a CPU with it) avx512vnni");
        zllm_isa::isa_choice().store(isa);
        return std::string(zllm_isa::isa_name(isa));
      },
      "force avx2 or avx512vnni, or auto (the best this CPU has); returns the choice",
      py::arg("name"));
  m.def("gguf_dequantize", &gguf_dequantize, "GGUF blocks -> fp32 rows");
  m.def("set_lattice_tables", &set_lattice_tables,
        "the IQ1-IQ3 grids (int8, by ggml type) and IQ2_XXS's ksigns, from gguf.quants",
        py::arg("types"), py::arg("grids"), py::arg("ksigns"));
  m.def("paged_decode_attention", &paged_decode_attention,
        "one-token-per-sequence attention read from the paged KV cache", py::arg("q"),
        py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("window") = 0, py::arg("sinks") = py::none());

  m.def("rms_norm_rows", &rms_norm_rows,
        "(weight * norm(x + residual), x + residual) over rows, fp32", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("rope_rows_", &rope_rows_, "RoPE in place on q/k heads (rotate_half layout)");
  m.def("gated_delta_decode_", &gated_delta_decode_,
        "a Gated DeltaNet layer's one-token step, its slots' states updated in place");
  m.def("causal_conv_decode_", &causal_conv_decode_,
        "a causal depthwise conv's one-input step with SiLU, its windows moved on in place",
        py::arg("x"), py::arg("conv"), py::arg("slots"), py::arg("weight"),
        py::arg("bias") = py::none());
  m.def("mamba2_decode_", &mamba2_decode_,
        "a Mamba-2 layer's one-token step, its slots' states updated in place");
  m.def("gated_activation_rows", &gated_activation_rows,
        "act(gate) * up of [T, gate | up]; activation 0 = SiLU, 1 = GELU (tanh)");

  using zllm_fused::DecodeStack;
  using zllm_fused::Matmul;
  py::class_<Matmul>(m, "FusedMatmul")
      .def(py::init<std::vector<at::Tensor>, std::vector<int64_t>, std::optional<at::Tensor>,
                    std::optional<at::Tensor>, int64_t, int64_t>(),
           py::arg("blocks"), py::arg("types"), py::arg("dense"), py::arg("bias"),
           py::arg("in_features"), py::arg("int8_max_rows"))
      .def_readonly("out_features", &Matmul::out_features)
      .def("__call__", [](const Matmul& matmul, const at::Tensor& x) {
        TORCH_CHECK(x.dim() == 2 && x.size(1) == matmul.in_features && x.is_contiguous() &&
                        x.scalar_type() == at::kFloat,
                    "x must be contiguous fp32 [M, in_features]");
        auto y = x.new_empty({x.size(0), matmul.out_features});
        matmul(x, y);
        return y;
      });
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, bool, int64_t,
                    at::Tensor>(),
           py::arg("hidden"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("rotary_dim"), py::arg("intermediate"), py::arg("eps"), py::arg("sandwich"),
           py::arg("activation"), py::arg("final_norm"))
      .def("add_rope_table", &DecodeStack::add_rope_table)
      .def("add_layer", &DecodeStack::add_layer, py::arg("attn_norm"), py::arg("ffn_norm"),
           py::arg("post_attn_norm"), py::arg("post_ffn_norm"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
           py::arg("rope_table"), py::arg("scale"))
      .def("num_layers", &DecodeStack::num_layers)
      // No Python object is touched inside: release the GIL for the step, so the executor's
      // other threads (the KV offload's disk writer) run meanwhile.
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>(),
           py::arg("x"), py::arg("positions"),
           py::arg("kv_caches"), py::arg("meta_of_layer"), py::arg("block_tables"),
           py::arg("slots"), py::arg("windows"), py::arg("seq_lens"),
           py::arg("final_norm") = true);
}
