// The slice of ATen the kernels use: at::Tensor and its methods (new_empty makes outputs),
// at::parallel_for (torch's OpenMP pool), TORCH_CHECK.
//
// Why: <torch/extension.h> pulls in all of libtorch's C++ API and pybind11, ~35 s of parsing
// per translation unit on a 2-core machine; these two headers cost ~5 s, and an op's own
// header (<ATen/ops/empty.h>) another ~4: a translation unit that needs one includes it itself
// (dense_rows.cpp: mm, addmm). Only ops.cpp, which binds the module to Python, includes the
// pybind11 side.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
