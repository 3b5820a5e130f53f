// What the CPU and CUDA fp8_block_quantize ops share before their kernels run: the argument checks
// and the two outputs (the float8 weight, and one float32 scale_inv per block of the last two
// dimensions, ceil on partial blocks). The quantization rule itself is fp8_block.h's.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fsdpfast {

struct Fp8BlockOutputs {
  at::Tensor in;         // the weight, contiguous
  at::Tensor out;        // float8_e4m3fn, the weight's shape
  at::Tensor scale_inv;  // float32, [..., row_blocks, col_blocks]
  int64_t rows, cols, row_blocks, col_blocks, leading;
};

inline Fp8BlockOutputs fp8_block_outputs(const at::Tensor& weight, int64_t block_rows, int64_t block_cols) {
  TORCH_CHECK(weight.dim() >= 2, "fp8_block_quantize takes a tensor of 2 or more dimensions, got ", weight.sizes());
  TORCH_CHECK(block_rows > 0 && block_cols > 0, "fp8_block_quantize: block sizes must be positive");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "fp8_block_quantize takes float32, bfloat16 or float16, got ", dtype);
  Fp8BlockOutputs o;
  o.in = weight.contiguous();
  o.rows = o.in.size(-2);
  o.cols = o.in.size(-1);
  o.row_blocks = (o.rows + block_rows - 1) / block_rows;
  o.col_blocks = (o.cols + block_cols - 1) / block_cols;
  o.leading = o.rows * o.cols == 0 ? 0 : o.in.numel() / (o.rows * o.cols);
  std::vector<int64_t> scale_shape(o.in.sizes().begin(), o.in.sizes().end() - 2);
  scale_shape.push_back(o.row_blocks);
  scale_shape.push_back(o.col_blocks);
  o.out = at::empty(o.in.sizes(), o.in.options().dtype(at::kFloat8_e4m3fn));
  o.scale_inv = at::empty(scale_shape, o.in.options().dtype(at::kFloat));
  return o;
}

}  // namespace fsdpfast
