// torch.ops.fsdpfast.fp8_block_quantize on CUDA: one thread block per 128x128 tile (any block
// size), which reduces the tile's amax in shared memory and then quantizes it. The rule and the
// float8 rounding are fp8_block.h's, the same code as the CPU kernel, so both give equal bytes.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "../fp8_block.h"
#include "../fp8_block_outputs.h"

namespace fsdpfast {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ float widened(T x) {
  return static_cast<float>(x);
}

template <typename T>
__global__ void fp8_block_kernel(const T* __restrict__ in, uint8_t* __restrict__ out, float* __restrict__ scale_inv,
                                 int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols,
                                 int64_t row_blocks, int64_t col_blocks) {
  const int64_t tile = blockIdx.x;  // (matrix, block row, column block)
  const int64_t matrix = tile / (row_blocks * col_blocks);
  const int64_t block_row = (tile / col_blocks) % row_blocks, block_col = tile % col_blocks;
  const int64_t r0 = block_row * block_rows, c0 = block_col * block_cols;
  const int64_t height = min(block_rows, rows - r0), width = min(block_cols, cols - c0);
  const T* base = in + matrix * rows * cols + r0 * cols + c0;
  uint8_t* target = out + matrix * rows * cols + r0 * cols + c0;
  float m = 0.0f;
  for (int64_t i = threadIdx.x; i < height * width; i += kThreads) m = fp8_block_amax_step(m, widened(base[(i / width) * cols + i % width]));
  __shared__ float partial[kThreads];
  partial[threadIdx.x] = m;
  __syncthreads();
  for (int step = kThreads / 2; step > 0; step /= 2) {
    if (threadIdx.x < step) partial[threadIdx.x] = fp8_block_amax_step(partial[threadIdx.x], partial[threadIdx.x + step]);
    __syncthreads();
  }
  const float scale = fp8_block_scale(partial[0]);
  if (threadIdx.x == 0) scale_inv[tile] = 1.0f / scale;
  for (int64_t i = threadIdx.x; i < height * width; i += kThreads) {
    const int64_t offset = (i / width) * cols + i % width;
    target[offset] = fp8_block_quantize_one(widened(base[offset]), scale);
  }
}

std::tuple<at::Tensor, at::Tensor> fp8_block_quantize_cuda(const at::Tensor& weight, int64_t block_rows,
                                                          int64_t block_cols) {
  const c10::cuda::CUDAGuard guard(weight.device());
  const Fp8BlockOutputs made = fp8_block_outputs(weight, block_rows, block_cols);
  const at::Tensor &in = made.in, &out = made.out, &scale_inv = made.scale_inv;
  const int64_t rows = made.rows, cols = made.cols, row_blocks = made.row_blocks, col_blocks = made.col_blocks;
  const int64_t leading = made.leading;
  const auto dtype = in.scalar_type();
  const int64_t tiles = leading * row_blocks * col_blocks;
  if (tiles == 0) return {out, scale_inv};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "fp8_block_quantize", [&] {
    fp8_block_kernel<scalar_t><<<tiles, kThreads, 0, stream>>>(in.data_ptr<scalar_t>(), static_cast<uint8_t*>(out.data_ptr()),
                                                               scale_inv.data_ptr<float>(), rows, cols, block_rows,
                                                               block_cols, row_blocks, col_blocks);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, scale_inv};
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdpfast, CUDA, m) { m.impl("fp8_block_quantize", &fp8_block_quantize_cuda); }

}  // namespace fsdpfast
