// Checks of plan tensors shared by the CPU and CUDA torch ops.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>

namespace fsdpfast {

// Pointer to the rows of a contiguous int64 CPU plan tensor [n, kColumns]; a torch error otherwise.
const int64_t* plan_rows(const at::Tensor& plan);

// plan_rows, plus every row's indices, sizes and codes (kernels.h check_rows), as torch errors.
void check_plan(const at::Tensor& plan, size_t sources, size_t destinations);

// check_plan, plus every row's byte range against the sizes of its source and destination tensors.
void check_plan_bounds(const at::Tensor& plan, at::TensorList sources, at::TensorList destinations);

}  // namespace fsdpfast
