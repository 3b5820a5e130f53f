// The transposed copy as torch ops (schemas in ops.cpp), CPU implementations over transpose.cpp:
//   transpose_copy(source, destination)  destination = source with its last two dimensions swapped,
//                                        converted to destination's dtype (float32/bfloat16/float16
//                                        among themselves, or equal dtypes of any kind); both contiguous.
//   transposed(source, dtype=None)       the same into a new tensor: source.transpose(-2, -1).contiguous()
//                                        (then .to(dtype)), bit for bit.
// The CUDA implementations are in cuda/transpose.cu.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <stdexcept>

#include "convert.h"
#include "transpose.h"

namespace fsdpfast {

int64_t transpose_code(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return kFloat32;
    case at::kBFloat16: return kBFloat16;
    case at::kHalf: return kFloat16;
    default: return kOther;
  }
}

// (batch, rows, cols) of a transposed copy from `source` into `destination`, both checked.
std::array<int64_t, 3> transpose_sizes(const at::Tensor& source, const at::Tensor& destination) {
  TORCH_CHECK(source.dim() >= 2, "transpose_copy: the source needs two dimensions at least, it has ", source.dim());
  TORCH_CHECK(source.is_contiguous() && destination.is_contiguous(), "transpose_copy: source and destination must be contiguous");
  auto wanted = source.sizes().vec();
  std::swap(wanted[wanted.size() - 1], wanted[wanted.size() - 2]);
  TORCH_CHECK(destination.sizes().vec() == wanted, "transpose_copy: the destination must be ", at::IntArrayRef(wanted), ", it is ",
              destination.sizes());
  const bool same = source.scalar_type() == destination.scalar_type();
  TORCH_CHECK(same || (transpose_code(source.scalar_type()) != kOther && transpose_code(destination.scalar_type()) != kOther),
              "transpose_copy: converts between float32, bfloat16 and float16 only, not ", source.scalar_type(), " to ",
              destination.scalar_type());
  const int64_t rows = source.size(-2), cols = source.size(-1);
  return {rows * cols == 0 ? 0 : source.numel() / (rows * cols), rows, cols};
}

namespace {

void transpose_copy_cpu(const at::Tensor& source, const at::Tensor& destination) {
  TORCH_CHECK(source.device().is_cpu() && destination.device().is_cpu(), "transpose_copy: CPU tensors here");
  const auto [batch, rows, cols] = transpose_sizes(source, destination);
  const bool same = source.scalar_type() == destination.scalar_type();
  const int64_t from = same ? 0 : transpose_code(source.scalar_type()), to = same ? 0 : transpose_code(destination.scalar_type());
  auto parallel = [](int64_t n, const std::function<void(int64_t, int64_t)>& body) { at::parallel_for(0, n, 1, body); };
  try {
    transpose_convert(static_cast<const unsigned char*>(source.data_ptr()), static_cast<unsigned char*>(destination.data_ptr()),
                      batch, rows, cols, from, to, source.element_size(), destination.element_size(), parallel);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace

// Composite over transpose_copy: runs on any device that implements it, and on fake tensors.
at::Tensor transposed(const at::Tensor& source, std::optional<at::ScalarType> dtype) {
  TORCH_CHECK(source.dim() >= 2, "transposed: the source needs two dimensions at least, it has ", source.dim());
  auto sizes = source.sizes().vec();
  std::swap(sizes[sizes.size() - 1], sizes[sizes.size() - 2]);
  auto result = at::empty(sizes, source.options().dtype(dtype.value_or(source.scalar_type())));
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fsdpfast::transpose_copy", "").typed<void(const at::Tensor&, const at::Tensor&)>();
  op.call(source.contiguous(), result);
  return result;
}

TORCH_LIBRARY_IMPL(fsdpfast, CPU, m) { m.impl("transpose_copy", &transpose_copy_cpu); }

TORCH_LIBRARY_IMPL(fsdpfast, CompositeExplicitAutograd, m) { m.impl("transposed", &transposed); }

}  // namespace fsdpfast
