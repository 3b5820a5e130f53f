// The fsdpfast torch ops: every schema, and the CPU implementations over the kernels.
//
// The schemas are all here, so one block says what torch.ops.fsdpfast holds; the other files
// only register implementations:
//   gather_convert         copies every extent of a plan from byte views of the input files into
//                          byte views of the output files, converting element types on the way, in
//                          one multithreaded pass (CPU here, CUDA in cuda/gather_convert.cu).
//   gather_convert_staged  the same from CPU views through pinned and device staging buffers and
//                          the GPU (CUDA only: cuda/gather_convert.cu).
//   convert_scalar         the element conversions one by one, so tests can check them anywhere.
//   lora_merge, lora_merge_bias  a weight (bias) with a LoRA adapter fused in (lora_merge.cpp).
//   transpose_copy, transposed    a tensor with its last two dimensions swapped (transpose_ops.cpp).
//   fp8_block_quantize     block-scaled float8_e4m3fn and its scale_inv (fp8_block.cpp, cuda/fp8_block.cu).
// An argument the op writes into is declared `Tensor(x!)`: torch.compile and opcheck rely on it.
// (Writing into files is the torch-free module's job: bindings.cpp.)
#include <Python.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <stdexcept>

#include "convert.h"
#include "kernels.h"
#include "plan_rows.h"
#include "torch_plan.h"

namespace fsdpfast {

const int64_t* plan_rows(const at::Tensor& plan) {
  TORCH_CHECK(plan.dim() == 2 && plan.size(1) == kColumns, "plan must be int64 [n, ", int64_t(kColumns), "]");
  TORCH_CHECK(plan.scalar_type() == at::kLong && plan.is_contiguous() && plan.device().is_cpu(),
              "plan must be a contiguous int64 CPU tensor");
  return plan.data_ptr<int64_t>();
}

void check_plan(const at::Tensor& plan, size_t sources, size_t destinations) {
  const int64_t* rows = plan_rows(plan);
  try {
    check_rows(rows, plan.size(0), sources, destinations);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
}

void check_plan_bounds(const at::Tensor& plan, at::TensorList sources, at::TensorList destinations) {
  check_plan(plan, sources.size(), destinations.size());
  const int64_t* rows = plan.data_ptr<int64_t>();
  try {
    for (int64_t r = 0; r < plan.size(0); ++r) {
      const int64_t* row = rows + r * kColumns;
      check_bounds(row, r, sources[row[kSource]].numel(), destinations[row[kDestination]].numel());
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
}

namespace {

ParallelFor aten_parallel_for() {
  return [](int64_t n, const std::function<void(int64_t, int64_t)>& body) { at::parallel_for(0, n, 1, body); };
}

template <typename Pointer>
std::vector<Pointer> byte_pointers(at::TensorList tensors, std::vector<int64_t>& sizes, const char* what) {
  std::vector<Pointer> pointers;
  for (const auto& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kByte,
                what, " must be contiguous uint8 CPU tensors");
    pointers.push_back(static_cast<Pointer>(t.data_ptr()));
    sizes.push_back(t.numel());
  }
  return pointers;
}

// Kernel errors (std exceptions) become torch errors with the same message.
template <typename Body>
void translated(Body body) {
  try {
    body();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
}

void gather_convert_cpu(at::TensorList sources, at::TensorList destinations, const at::Tensor& plan) {
  const int64_t* rows = plan_rows(plan);
  std::vector<int64_t> source_bytes, destination_bytes;
  auto src = byte_pointers<const unsigned char*>(sources, source_bytes, "sources");
  auto dst = byte_pointers<unsigned char*>(destinations, destination_bytes, "destinations");
  translated([&] { gather_convert(src, source_bytes, dst, destination_bytes, rows, plan.size(0), aten_parallel_for()); });
}

// The scalar conversions the CUDA kernels use, run on the CPU so tests can check them anywhere.
at::Tensor convert_scalar(const at::Tensor& source, int64_t from, int64_t to) {
  TORCH_CHECK(source.device().is_cpu() && source.is_contiguous() && source.scalar_type() == at::kByte,
              "convert_scalar takes a contiguous uint8 CPU tensor");
  TORCH_CHECK(from != to && from != kOther && to != kOther, "convert_scalar converts between float codes");
  const int64_t in = from == kFloat32 ? 4 : 2, out = to == kFloat32 ? 4 : 2;
  const int64_t n = source.numel() / in;
  auto result = at::empty({n * out}, source.options());
  const unsigned char* src = source.data_ptr<unsigned char>();
  unsigned char* dst = result.data_ptr<unsigned char>();
  for (int64_t i = 0; i < n; ++i) convert_element(from, to, src + i * in, dst + i * out);
  return result;
}

}  // namespace

TORCH_LIBRARY(fsdpfast, m) {
  m.def("gather_convert(Tensor[] sources, Tensor(a!)[] destinations, Tensor plan) -> ()");
  m.def(
      "gather_convert_staged(Tensor[] sources, Tensor(a!)[] destinations, Tensor plan, Tensor(b!)[] pinned_in, "
      "Tensor(c!)[] pinned_out, Tensor(d!)[] device_in, Tensor(e!)[] device_out) -> ()");
  m.def("convert_scalar(Tensor source, int source_code, int target_code) -> Tensor");
  m.def("lora_merge(Tensor weight, Tensor lora_A, Tensor lora_B, float scaling, bool fan_in_fan_out, bool embedding) -> Tensor");
  m.def("lora_merge_bias(Tensor bias, Tensor lora_bias, float scaling) -> Tensor");
  m.def("transpose_copy(Tensor source, Tensor(a!) destination) -> ()");
  m.def("transposed(Tensor source, ScalarType? dtype=None) -> Tensor");
  m.def("fp8_block_quantize(Tensor weight, int block_rows, int block_cols) -> (Tensor, Tensor)");  // fp8_block.cpp
  // the scalar CPU kernel it replaced, kept to measure side by side (fp8_block.cpp; CPU only)
  m.def("fp8_block_quantize_scalar(Tensor weight, int block_rows, int block_cols) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fsdpfast, CPU, m) {
  m.impl("gather_convert", &gather_convert_cpu);
  m.impl("convert_scalar", &convert_scalar);
}

}  // namespace fsdpfast

// `import fsdpfast._C` loads this library, whose static initialisers register the ops above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "fsdpfast native ops (torch.ops.fsdpfast)", -1, nullptr};
  return PyModule_Create(&module);
}
