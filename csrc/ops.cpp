// The fsdpfast ops: schemas, and their CPU implementations.
//
// gather_convert copies every extent of a plan from byte views of the input files into byte
// views of the output files, converting element types on the way, in one multithreaded pass.
#include <Python.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "convert.h"
#include "plan_rows.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FSDPFAST_X86 1
#endif

namespace fsdpfast {

void check_plan(const at::Tensor& plan, size_t sources, size_t destinations) {
  TORCH_CHECK(plan.dim() == 2 && plan.size(1) == kColumns, "plan must be int64 [n, ", int64_t(kColumns), "]");
  TORCH_CHECK(plan.scalar_type() == at::kLong && plan.is_contiguous() && plan.device().is_cpu(),
              "plan must be a contiguous int64 CPU tensor");
  const int64_t* rows = plan.data_ptr<int64_t>();
  for (int64_t r = 0; r < plan.size(0); ++r) {
    const int64_t* row = rows + r * kColumns;
    TORCH_CHECK(row[kSource] >= 0 && size_t(row[kSource]) < sources, "plan row ", r, ": bad source index");
    TORCH_CHECK(row[kDestination] >= 0 && size_t(row[kDestination]) < destinations, "plan row ", r, ": bad destination index");
    TORCH_CHECK(row[kCount] >= 0 && row[kRuns] >= 0 && row[kSourceOffset] >= 0 && row[kTargetOffset] >= 0,
                "plan row ", r, ": negative size or offset");
    TORCH_CHECK(row[kSourceCode] == row[kTargetCode] ? row[kSourceItemsize] == row[kTargetItemsize]
                                                     : row[kSourceCode] != kOther && row[kTargetCode] != kOther,
                "plan row ", r, ": unsupported conversion");
  }
}

namespace {

// Bytes one row may touch, checked against the views before any byte moves.
void check_bounds(const int64_t* row, int64_t row_index, int64_t source_bytes, int64_t target_bytes) {
  if (row[kRuns] == 0 || row[kCount] == 0) return;
  int64_t last_run = row[kRuns] - 1;
  int64_t src_end = (row[kSourceOffset] + last_run * row[kSourceStride] + row[kCount]) * row[kSourceItemsize];
  int64_t dst_end = (row[kTargetOffset] + last_run * row[kTargetStride] + row[kCount]) * row[kTargetItemsize];
  TORCH_CHECK(src_end <= source_bytes, "plan row ", row_index, " reads past its source (", src_end, " > ", source_bytes, ")");
  TORCH_CHECK(dst_end <= target_bytes, "plan row ", row_index, " writes past its destination (", dst_end, " > ", target_bytes, ")");
}

void convert_f32_to_bf16(const uint32_t* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);  // branch-free: the compiler vectorises it
}

#ifdef FSDPFAST_X86
__attribute__((target("avx,f16c"))) void convert_f32_to_f16_f16c(const uint32_t* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(reinterpret_cast<const float*>(src + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

__attribute__((target("avx,f16c"))) void convert_f16_to_f32_f16c(const uint16_t* src, uint32_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(reinterpret_cast<float*>(dst + i), _mm256_cvtph_ps(v));
  }
  for (; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}

bool has_f16c() {
  static const bool supported = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return supported;
}
#endif

// The F16C instructions give exactly the software results of convert.h, only faster.
void convert_f32_to_f16(const uint32_t* src, uint16_t* dst, int64_t n) {
#ifdef FSDPFAST_X86
  if (has_f16c()) return convert_f32_to_f16_f16c(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

void convert_f16_to_f32(const uint16_t* src, uint32_t* dst, int64_t n) {
#ifdef FSDPFAST_X86
  if (has_f16c()) return convert_f16_to_f32_f16c(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}

void convert_run(int64_t from, int64_t to, const unsigned char* src, unsigned char* dst, int64_t n) {
  if (from == kFloat32 && to == kBFloat16)
    return convert_f32_to_bf16(reinterpret_cast<const uint32_t*>(src), reinterpret_cast<uint16_t*>(dst), n);
  if (from == kFloat32 && to == kFloat16)
    return convert_f32_to_f16(reinterpret_cast<const uint32_t*>(src), reinterpret_cast<uint16_t*>(dst), n);
  if (from == kFloat16 && to == kFloat32)
    return convert_f16_to_f32(reinterpret_cast<const uint16_t*>(src), reinterpret_cast<uint32_t*>(dst), n);
  if (from == kBFloat16 && to == kFloat32) {
    auto s = reinterpret_cast<const uint16_t*>(src);
    auto d = reinterpret_cast<uint32_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
    return;
  }
  // Between the 16-bit kinds: element by element through float32 bits.
  int64_t in = from == kFloat32 ? 4 : 2, out = to == kFloat32 ? 4 : 2;
  for (int64_t i = 0; i < n; ++i) convert_element(from, to, src + i * in, dst + i * out);
}

void run_task(const Task& task, const int64_t* rows, const std::vector<unsigned char*>& sources,
              const std::vector<unsigned char*>& destinations) {
  const int64_t* row = rows + task.row * kColumns;
  const int64_t in = row[kSourceItemsize], out = row[kTargetItemsize];
  const unsigned char* src_base = sources[row[kSource]];
  unsigned char* dst_base = destinations[row[kDestination]];
  const int64_t n = task.elem_end - task.elem_begin;
  for (int64_t run = task.run_begin; run < task.run_end; ++run) {
    const unsigned char* src = src_base + (row[kSourceOffset] + run * row[kSourceStride] + task.elem_begin) * in;
    unsigned char* dst = dst_base + (row[kTargetOffset] + run * row[kTargetStride] + task.elem_begin) * out;
    if (row[kSourceCode] == row[kTargetCode]) {
      std::memcpy(dst, src, n * in);
    } else {
      convert_run(row[kSourceCode], row[kTargetCode], src, dst, n);
    }
  }
}

std::vector<unsigned char*> byte_pointers(at::TensorList tensors, const char* what) {
  std::vector<unsigned char*> pointers;
  for (const auto& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kByte,
                what, " must be contiguous uint8 CPU tensors");
    pointers.push_back(static_cast<unsigned char*>(t.data_ptr()));
  }
  return pointers;
}

void gather_convert_cpu(at::TensorList sources, at::TensorList destinations, const at::Tensor& plan) {
  check_plan(plan, sources.size(), destinations.size());
  const int64_t* rows = plan.data_ptr<int64_t>();
  for (int64_t r = 0; r < plan.size(0); ++r) {
    const int64_t* row = rows + r * kColumns;
    check_bounds(row, r, sources[row[kSource]].numel(), destinations[row[kDestination]].numel());
  }
  auto src = byte_pointers(sources, "sources");
  auto dst = byte_pointers(destinations, "destinations");
  const auto tasks = split_tasks(rows, plan.size(0), int64_t(1) << 16);
  at::parallel_for(0, int64_t(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) run_task(tasks[i], rows, src, dst);
  });
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
  m.def("convert_scalar(Tensor source, int source_code, int target_code) -> Tensor");
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
