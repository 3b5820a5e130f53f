// torch.ops.fsdpfast.fp8_block_quantize on the CPU: block-scaled float8_e4m3fn weights and their
// float32 scale_inv (the rule: fp8_block.h). The schema is in ops.cpp.
//
// One task per (leading index, block row): it reads that block row's elements once for the
// block amaxes, a second time (still in cache for the usual widths) to quantize, so the extra
// memory is one float per column block whatever the weight's size.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
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

// float32 -> float8_e4m3fn as f32_to_e4m3fn (fp8_block.h), with the three cases selected instead of
// branched to, so that the compiler vectorises the loop that calls it (the same bytes).
inline uint8_t e4m3fn_selected(float f) {
  const uint32_t bits = fp8_float_bits(f);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t ax = bits & 0x7FFFFFFFu;
  const uint32_t subnormal = fp8_float_bits(fp8_bits_float(ax) + 16384.0f) - 0x46800000u;
  const uint32_t normal = (ax + 0x7FFFFu + ((ax >> 20) & 1u) - (120u << 23)) >> 20;  // wraps when unused
  const uint32_t magnitude = ax >= 0x43F00000u ? 0x7Fu : (ax < 0x3C800000u ? subnormal : normal);
  return static_cast<uint8_t>(sign | (magnitude & 0x7Fu));
}

// Each column block's scale (kept for the quantization) and scale_inv (stored), from its amax.
inline void block_scales(const std::vector<float>& amax, std::vector<float>& scale, float* scale_inv) {
  for (size_t b = 0; b < amax.size(); ++b) {
    scale[b] = fp8_block_scale(amax[b]);
    scale_inv[b] = 1.0f / scale[b];
  }
}

// The block row, vectorised: each row's segment of a column block is widened into a float buffer,
// its amax taken 8/16 lanes at a time (at::vec::maximum propagates NaN, as fp8_block_amax_step
// does), and quantized by a branch-free loop the compiler vectorises.
template <typename T>
void quantize_block_row(const T* in, uint8_t* out, float* scale_inv, int64_t rows, int64_t cols, int64_t block_rows,
                        int64_t block_cols) {
  using Vec = at::vec::Vectorized<float>;
  const int64_t col_blocks = (cols + block_cols - 1) / block_cols;
  std::vector<float> amax(col_blocks, 0.0f), scale(col_blocks), wide(block_cols);
  float* w = wide.data();
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = in + r * cols;
    for (int64_t b = 0; b < col_blocks; ++b) {
      const int64_t start = b * block_cols, width = std::min(cols, start + block_cols) - start;
      for (int64_t c = 0; c < width; ++c) w[c] = widened(row[start + c]);
      int64_t c = 0;
      Vec m(0.0f);
      for (; c + Vec::size() <= width; c += Vec::size()) m = at::vec::maximum(m, Vec::loadu(w + c).abs());
      float lanes[Vec::size()];
      m.store(lanes);
      float a = amax[b];
      for (int64_t l = 0; l < Vec::size(); ++l) a = fp8_block_amax_step(a, lanes[l]);
      for (; c < width; ++c) a = fp8_block_amax_step(a, w[c]);
      amax[b] = a;
    }
  }
  block_scales(amax, scale, scale_inv);
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = in + r * cols;
    uint8_t* o = out + r * cols;
    for (int64_t b = 0; b < col_blocks; ++b) {
      const int64_t start = b * block_cols, width = std::min(cols, start + block_cols) - start;
      const float s = scale[b];
      for (int64_t c = 0; c < width; ++c) w[c] = widened(row[start + c]);
      for (int64_t c = 0; c < width; ++c) {
        float y = w[c] * s;
        y = y > kFp8Max ? kFp8Max : (y < -kFp8Max ? -kFp8Max : y);  // NaN passes, as torch.clamp
        o[start + c] = e4m3fn_selected(y);
      }
    }
  }
}

// The scalar kernel it replaced (one element at a time, fp8_block.h's functions): kept as the op
// fp8_block_quantize_scalar, to measure the two side by side (benchmarks/bench_fp8_kernel.py).
template <typename T>
void quantize_block_row_scalar(const T* in, uint8_t* out, float* scale_inv, int64_t rows, int64_t cols,
                               int64_t block_rows, int64_t block_cols) {
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
  block_scales(amax, scale, scale_inv);
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

template <bool kVectorised>
std::tuple<at::Tensor, at::Tensor> quantize_on_cpu(const at::Tensor& weight, int64_t block_rows, int64_t block_cols) {
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
        if constexpr (kVectorised) {
          quantize_block_row(x + first, o + first, s + t * col_blocks, height, cols, block_rows, block_cols);
        } else {
          quantize_block_row_scalar(x + first, o + first, s + t * col_blocks, height, cols, block_rows, block_cols);
        }
      }
    });
  });
  return {out, scale_inv};
}

std::tuple<at::Tensor, at::Tensor> fp8_block_quantize_cpu(const at::Tensor& weight, int64_t block_rows,
                                                         int64_t block_cols) {
  return quantize_on_cpu<true>(weight, block_rows, block_cols);
}

std::tuple<at::Tensor, at::Tensor> fp8_block_quantize_scalar_cpu(const at::Tensor& weight, int64_t block_rows,
                                                                int64_t block_cols) {
  return quantize_on_cpu<false>(weight, block_rows, block_cols);
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdpfast, CPU, m) {
  m.impl("fp8_block_quantize", &fp8_block_quantize_cpu);
  m.impl("fp8_block_quantize_scalar", &fp8_block_quantize_scalar_cpu);
}

}  // namespace fsdpfast
