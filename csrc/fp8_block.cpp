// torch.ops.fsdpfast.fp8_block_quantize on the CPU: block-scaled float8_e4m3fn weights and their
// float32 scale_inv (the rule: fp8_block.h). The schema is in ops.cpp.
//
// One task per (leading index, block row): it reads that block row's elements once for the
// block amaxes, a second time (still in cache for the usual widths) to quantize, so the extra
// memory is one float per column block whatever the weight's size.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "fp8_block.h"
#include "fp8_block_outputs.h"

namespace fsdpfast {
namespace {

template <typename T>
inline float widened(T x) {
  return static_cast<float>(x);
}

template <typename T>
void quantize_block_row(const T* in, uint8_t* out, float* scale_inv, int64_t rows, int64_t cols, int64_t block_rows,
                        int64_t block_cols) {
  const int64_t col_blocks = (cols + block_cols - 1) / block_cols;
  std::vector<float> amax(col_blocks, 0.0f), scale(col_blocks);
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = in + r * cols;
    for (int64_t b = 0; b < col_blocks; ++b) {
      const int64_t end = std::min(cols, (b + 1) * block_cols);
      float m = amax[b];
      for (int64_t c = b * block_cols; c < end; ++c) m = fp8_block_amax_step(m, widened(row[c]));
      amax[b] = m;
    }
  }
  for (int64_t b = 0; b < col_blocks; ++b) {
    scale[b] = fp8_block_scale(amax[b]);
    scale_inv[b] = 1.0f / scale[b];
  }
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = in + r * cols;
    uint8_t* o = out + r * cols;
    for (int64_t b = 0; b < col_blocks; ++b) {
      const int64_t end = std::min(cols, (b + 1) * block_cols);
      const float s = scale[b];
      for (int64_t c = b * block_cols; c < end; ++c) o[c] = fp8_block_quantize_one(widened(row[c]), s);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> fp8_block_quantize_cpu(const at::Tensor& weight, int64_t block_rows,
                                                         int64_t block_cols) {
  const Fp8BlockOutputs made = fp8_block_outputs(weight, block_rows, block_cols);
  const at::Tensor &in = made.in, &out = made.out, &scale_inv = made.scale_inv;
  const int64_t rows = made.rows, cols = made.cols, row_blocks = made.row_blocks, col_blocks = made.col_blocks;
  const int64_t leading = made.leading;
  const auto dtype = in.scalar_type();
  uint8_t* o = static_cast<uint8_t*>(out.data_ptr());
  float* s = scale_inv.data_ptr<float>();
  const int64_t tasks = leading * row_blocks;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "fp8_block_quantize", [&] {
    const scalar_t* x = in.data_ptr<scalar_t>();
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t matrix = t / row_blocks, block_row = t % row_blocks;
        const int64_t first = matrix * rows * cols + block_row * block_rows * cols;
        const int64_t height = std::min(block_rows, rows - block_row * block_rows);
        quantize_block_row(x + first, o + first, s + t * col_blocks, height, cols, block_rows, block_cols);
      }
    });
  });
  return {out, scale_inv};
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdpfast, CPU, m) { m.impl("fp8_block_quantize", &fp8_block_quantize_cpu); }

}  // namespace fsdpfast
