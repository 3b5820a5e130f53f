// The transposed copy on the GPU (schemas in ops.cpp, CPU version in transpose_ops.cpp): a 32 x 32 tile
// per block through shared memory, so that reads along the source rows and writes along the destination
// rows are both coalesced; the padding column keeps the tile's column reads free of bank conflicts.
// Conversions use convert.h's bit-exact element functions, as the gather kernels do.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <array>
#include <cstdint>

#include "../convert.h"

namespace fsdpfast {

int64_t transpose_code(at::ScalarType type);  // transpose_ops.cpp
std::array<int64_t, 3> transpose_sizes(const at::Tensor& source, const at::Tensor& destination);

namespace {

constexpr int kTile = 32, kRowsPerPass = 8;

// One element from `From` (In) to `To` (Out); From == To == kOther: the bits as they are.
template <typename In, typename Out, int64_t From, int64_t To>
__device__ __forceinline__ Out converted(In value) {
  if constexpr (From == To) {
    return value;
  } else {
    Out out;
    convert_element(From, To, reinterpret_cast<const unsigned char*>(&value), reinterpret_cast<unsigned char*>(&out));
    return out;
  }
}

template <typename In, typename Out, int64_t From, int64_t To>
__global__ void transpose_kernel(const In* __restrict__ src, Out* __restrict__ dst, int64_t batch, int64_t rows, int64_t cols) {
  __shared__ Out tile[kTile][kTile + 1];
  const int64_t c0 = int64_t(blockIdx.x) * kTile, r0 = int64_t(blockIdx.y) * kTile;
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    const In* s = src + b * rows * cols;
    Out* d = dst + b * rows * cols;
    for (int k = threadIdx.y; k < kTile; k += kRowsPerPass) {  // read rows of the source tile
      const int64_t r = r0 + k, c = c0 + threadIdx.x;
      if (r < rows && c < cols) tile[k][threadIdx.x] = converted<In, Out, From, To>(s[r * cols + c]);
    }
    __syncthreads();
    for (int k = threadIdx.y; k < kTile; k += kRowsPerPass) {  // write rows of the destination tile
      const int64_t c = c0 + k, r = r0 + threadIdx.x;
      if (r < rows && c < cols) d[c * rows + r] = tile[threadIdx.x][k];
    }
    __syncthreads();
  }
}

template <typename In, typename Out, int64_t From, int64_t To>
void launch(const at::Tensor& source, const at::Tensor& destination, int64_t batch, int64_t rows, int64_t cols) {
  const dim3 block(kTile, kRowsPerPass);
  const dim3 grid(unsigned((cols + kTile - 1) / kTile), unsigned((rows + kTile - 1) / kTile), unsigned(std::min<int64_t>(batch, 65535)));
  TORCH_CHECK((cols + kTile - 1) / kTile < (int64_t(1) << 31) && (rows + kTile - 1) / kTile <= 65535,
              "transpose_copy: a matrix of ", rows, " x ", cols, " is too large for one launch");
  transpose_kernel<In, Out, From, To><<<grid, block, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const In*>(source.data_ptr()), static_cast<Out*>(destination.data_ptr()), batch, rows, cols);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename In, int64_t From>
void launch_from(const at::Tensor& source, const at::Tensor& destination, int64_t to, int64_t batch, int64_t rows, int64_t cols) {
  if (to == kFloat32) return launch<In, uint32_t, From, kFloat32>(source, destination, batch, rows, cols);
  if (to == kBFloat16) return launch<In, uint16_t, From, kBFloat16>(source, destination, batch, rows, cols);
  return launch<In, uint16_t, From, kFloat16>(source, destination, batch, rows, cols);
}

void transpose_copy_cuda(const at::Tensor& source, const at::Tensor& destination) {
  TORCH_CHECK(source.is_cuda() && destination.is_cuda() && source.device() == destination.device(),
              "transpose_copy: source and destination on one GPU");
  const auto [batch, rows, cols] = transpose_sizes(source, destination);
  if (batch == 0) return;
  const c10::cuda::CUDAGuard guard(source.device());
  if (source.scalar_type() == destination.scalar_type()) {
    switch (source.element_size()) {
      case 1: return launch<uint8_t, uint8_t, kOther, kOther>(source, destination, batch, rows, cols);
      case 2: return launch<uint16_t, uint16_t, kOther, kOther>(source, destination, batch, rows, cols);
      case 4: return launch<uint32_t, uint32_t, kOther, kOther>(source, destination, batch, rows, cols);
      case 8: return launch<uint64_t, uint64_t, kOther, kOther>(source, destination, batch, rows, cols);
      default: TORCH_CHECK(false, "transpose_copy: elements of ", source.element_size(), " bytes are not handled on the GPU");
    }
  }
  const int64_t from = transpose_code(source.scalar_type()), to = transpose_code(destination.scalar_type());
  if (from == kFloat32) return launch_from<uint32_t, kFloat32>(source, destination, to, batch, rows, cols);
  if (from == kBFloat16) return launch_from<uint16_t, kBFloat16>(source, destination, to, batch, rows, cols);
  return launch_from<uint16_t, kFloat16>(source, destination, to, batch, rows, cols);
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdpfast, CUDA, m) { m.impl("transpose_copy", &transpose_copy_cuda); }

}  // namespace fsdpfast
