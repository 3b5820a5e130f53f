// CUDA implementations: gather_convert on device tensors, and the staged pipeline that merges
// CPU-resident (memory-mapped) shards through pinned buffers and the GPU.
//
// Pipeline per staging slot k (of at least two): the CPU packs pieces of extents into pinned
// buffer k, stream k copies them to the device, converts them and copies them back, and an event
// marks slot k done. While the GPU works on slot k the CPU already packs slot k+1 and unpacks
// the finished slot k-1 into the output views, so reading, converting and writing overlap.
//
// The host copies run on torch's OpenMP threads (at::parallel_for), which exist in this file only
// because setup.py hands -fopenmp to nvcc's host compiler: without it ATen's parallel_for compiles
// to a plain loop here, and every copy in and out of the pinned buffers ran on one thread.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <vector>

#include "../convert.h"
#include "../kernels.h"
#include "../plan_rows.h"
#include "../torch_plan.h"

#if !defined(__CUDA_ARCH__) && !defined(_OPENMP)
#error "build the CUDA ops with -Xcompiler -fopenmp (setup.py does): without it every host copy runs on one thread"
#endif

namespace fsdpfast {
namespace {

template <int64_t From, int64_t To>
__global__ void convert_flat_kernel(const unsigned char* __restrict__ in, unsigned char* __restrict__ out, int64_t n) {
  constexpr int64_t in_size = From == kFloat32 ? 4 : 2;
  constexpr int64_t out_size = To == kFloat32 ? 4 : 2;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    convert_element(From, To, in + i * in_size, out + i * out_size);
  }
}

void launch_convert(int64_t from, int64_t to, const unsigned char* in, unsigned char* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 65535 * 8);
#define FSDPFAST_CASE(F, T) \
  if (from == F && to == T) return convert_flat_kernel<F, T><<<blocks, threads, 0, stream>>>(in, out, n);
  FSDPFAST_CASE(kFloat32, kBFloat16)
  FSDPFAST_CASE(kFloat32, kFloat16)
  FSDPFAST_CASE(kBFloat16, kFloat32)
  FSDPFAST_CASE(kFloat16, kFloat32)
  FSDPFAST_CASE(kBFloat16, kFloat16)
  FSDPFAST_CASE(kFloat16, kBFloat16)
#undef FSDPFAST_CASE
  // check_plan_bounds accepted only these pairs for rows whose codes differ.
  TORCH_INTERNAL_ASSERT(false, "unsupported conversion ", from, " -> ", to);
}

// --- gather_convert on device-resident views: one block per task ---

constexpr int kTaskFields = 6;  // row, run_begin, run_end, elem_begin, elem_end, aligned

// One element through registers, byte by byte: a view may start at any byte (a slice of a uint8
// buffer), and a 2- or 4-byte load or store at an address that is not a multiple of its size
// faults on the GPU ("misaligned address") where the CPU would only be slow.
__device__ __forceinline__ void convert_unaligned(int64_t from, int64_t to, const unsigned char* in, unsigned char* out,
                                                  int64_t in_size, int64_t out_size) {
  alignas(4) unsigned char a[4];
  alignas(4) unsigned char b[4];
  for (int64_t k = 0; k < in_size; ++k) a[k] = in[k];
  convert_element(from, to, a, b);
  for (int64_t k = 0; k < out_size; ++k) out[k] = b[k];
}

__global__ void gather_convert_kernel(const int64_t* __restrict__ rows, const int64_t* __restrict__ tasks,
                                      unsigned char* const* sources, unsigned char* const* destinations) {
  const int64_t* task = tasks + blockIdx.x * int64_t(kTaskFields);
  const int64_t* row = rows + task[0] * kColumns;
  const int64_t in = row[kSourceItemsize], out = row[kTargetItemsize];
  const int64_t from = row[kSourceCode], to = row[kTargetCode];
  const bool aligned = task[5] != 0;
  for (int64_t run = task[1]; run < task[2]; ++run) {
    const unsigned char* src = sources[row[kSource]] + (row[kSourceOffset] + run * row[kSourceStride]) * in;
    unsigned char* dst = destinations[row[kDestination]] + (row[kTargetOffset] + run * row[kTargetStride]) * out;
    for (int64_t i = task[3] + threadIdx.x; i < task[4]; i += blockDim.x) {
      if (from == to) {
        for (int64_t b = 0; b < in; ++b) dst[i * out + b] = src[i * in + b];
      } else if (aligned) {
        convert_element(from, to, src + i * in, dst + i * out);
      } else {
        convert_unaligned(from, to, src + i * in, dst + i * out, in, out);
      }
    }
  }
}

std::vector<int64_t> device_pointers(at::TensorList tensors, const at::Device& device) {
  std::vector<int64_t> pointers;
  for (const auto& t : tensors) {
    TORCH_CHECK(t.device() == device && t.is_contiguous() && t.scalar_type() == at::kByte,
                "gather_convert (CUDA): views must be contiguous uint8 tensors on ", device);
    pointers.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
  }
  return pointers;
}

void gather_convert_cuda(at::TensorList sources, at::TensorList destinations, const at::Tensor& plan) {
  check_plan_bounds(plan, sources, destinations);
  TORCH_CHECK(!destinations.empty(), "gather_convert (CUDA): no destinations");
  const at::Device device = destinations[0].device();
  c10::cuda::CUDAGuard guard(device);
  const int64_t* rows = plan.data_ptr<int64_t>();
  auto tasks = split_tasks(rows, plan.size(0), int64_t(1) << 14);
  if (tasks.empty()) return;
  const auto source_pointers = device_pointers(sources, device);
  const auto destination_pointers = device_pointers(destinations, device);
  // Offsets are counted in elements, so a row's elements are all aligned exactly when its source
  // and destination views start at a multiple of their element sizes: decided once per row here.
  auto aligned = [&](int64_t r) {
    const int64_t* row = rows + r * kColumns;
    return source_pointers[row[kSource]] % row[kSourceItemsize] == 0 &&
           destination_pointers[row[kDestination]] % row[kTargetItemsize] == 0;
  };
  std::vector<int64_t> flat_tasks;
  for (const auto& t : tasks)
    flat_tasks.insert(flat_tasks.end(), {t.row, t.run_begin, t.run_end, t.elem_begin, t.elem_end, int64_t(aligned(t.row))});
  auto options = at::TensorOptions().dtype(at::kLong);
  auto to_device = [&](const std::vector<int64_t>& v) {
    return at::from_blob(const_cast<int64_t*>(v.data()), {int64_t(v.size())}, options).to(device);
  };
  auto d_rows = plan.to(device);
  auto d_tasks = to_device(flat_tasks);
  auto d_sources = to_device(source_pointers);
  auto d_destinations = to_device(destination_pointers);
  auto stream = at::cuda::getCurrentCUDAStream();
  gather_convert_kernel<<<tasks.size(), 256, 0, stream>>>(
      d_rows.data_ptr<int64_t>(), d_tasks.data_ptr<int64_t>(),
      reinterpret_cast<unsigned char* const*>(d_sources.data_ptr<int64_t>()),
      reinterpret_cast<unsigned char* const*>(d_destinations.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// --- the staged pipeline ---

struct Piece {  // a contiguous run of elements: where it is read, where it lands, where it sits in the slot
  const unsigned char* src;
  unsigned char* dst;
  int64_t count, slot_offset;
};

struct Span {  // bytes to copy on the host
  unsigned char* dst;
  const unsigned char* src;
  int64_t bytes;
};

// Host copies on every thread, cut into 1 MB pieces so that one large tensor spreads over the
// threads as evenly as many small ones (a slot often holds a single piece of 64 MB).
void parallel_copy(const std::vector<Span>& spans) {
  constexpr int64_t kPiece = int64_t(1) << 20;
  std::vector<Span> pieces;
  for (const Span& s : spans)
    for (int64_t offset = 0; offset < s.bytes; offset += kPiece)
      pieces.push_back({s.dst + offset, s.src + offset, std::min(kPiece, s.bytes - offset)});
  at::parallel_for(0, int64_t(pieces.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].bytes);
  });
}

ParallelFor aten_threads() {
  return [](int64_t n, const std::function<void(int64_t, int64_t)>& body) { at::parallel_for(0, n, 1, body); };
}

struct Slot {
  unsigned char* pinned_in;
  unsigned char* pinned_out;
  unsigned char* device_in;
  unsigned char* device_out;
  c10::cuda::CUDAStream stream;
  at::cuda::CUDAEvent done;
  std::vector<Piece> pieces;
  int64_t out_itemsize = 0;
  bool busy = false;
};

// Waits for every slot's stream when the op is left, by return or by exception: the staging
// buffers are the caller's and the next call reuses them (execute/cuda.py keeps one set per
// process), so no copy may still run into or out of them once control is back in Python.
class DrainSlots {
 public:
  explicit DrainSlots(std::vector<Slot>& slots) : slots_(slots) {}
  DrainSlots(const DrainSlots&) = delete;
  DrainSlots& operator=(const DrainSlots&) = delete;
  ~DrainSlots() {
    for (auto& slot : slots_) {
      // No throwing from a destructor: an error here belongs to the exception already on its way,
      // so it is cleared rather than left to fail some later, unrelated CUDA call.
      if (cudaStreamSynchronize(slot.stream.stream()) != cudaSuccess) (void)cudaGetLastError();
    }
  }

 private:
  std::vector<Slot>& slots_;
};

void unpack(Slot& slot) {
  if (!slot.busy) return;
  slot.done.synchronize();
  std::vector<Span> spans;
  for (const Piece& p : slot.pieces) spans.push_back({p.dst, slot.pinned_out + p.slot_offset * slot.out_itemsize, p.count * slot.out_itemsize});
  parallel_copy(spans);
  slot.pieces.clear();
  slot.busy = false;
}

void launch(Slot& slot, int64_t from, int64_t to, int64_t elements) {
  const int64_t in = from == kFloat32 ? 4 : 2, out = to == kFloat32 ? 4 : 2;
  std::vector<Span> spans;
  for (const Piece& p : slot.pieces) spans.push_back({slot.pinned_in + p.slot_offset * in, p.src, p.count * in});
  parallel_copy(spans);
  cudaStream_t s = slot.stream.stream();
  slot.busy = true;  // from the first enqueued copy on, the slot must be waited for
  C10_CUDA_CHECK(cudaMemcpyAsync(slot.device_in, slot.pinned_in, elements * in, cudaMemcpyHostToDevice, s));
  launch_convert(from, to, slot.device_in, slot.device_out, elements, s);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  C10_CUDA_CHECK(cudaMemcpyAsync(slot.pinned_out, slot.device_out, elements * out, cudaMemcpyDeviceToHost, s));
  slot.done.record(slot.stream);
  slot.out_itemsize = out;
}

void check_staging_buffer(const at::Tensor& t, int64_t bytes, bool pinned, const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous() && t.numel() == bytes,
              "staging buffers must be contiguous uint8 tensors, all of one size");
  if (pinned) {
    TORCH_CHECK(t.device().is_cpu() && t.is_pinned(), "staging host buffers must be pinned");
  } else {
    // The conversion kernel loads and stores 2 and 4 bytes at a time from the start of these.
    TORCH_CHECK(t.device() == device && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
                "staging device buffers must be 16-byte aligned, on one device");
  }
}

void gather_convert_staged(at::TensorList sources, at::TensorList destinations, const at::Tensor& plan,
                           at::TensorList pinned_in, at::TensorList pinned_out, at::TensorList device_in,
                           at::TensorList device_out) {
  check_plan_bounds(plan, sources, destinations);
  const size_t slots_count = pinned_in.size();
  TORCH_CHECK(slots_count >= 2 && pinned_out.size() == slots_count && device_in.size() == slots_count &&
                  device_out.size() == slots_count,
              "gather_convert_staged needs at least two staging slots of four buffers each");
  // Every buffer holds capacity_bytes; a batch of one dtype pair holds capacity_bytes / max(in, out)
  // elements, so no buffer is larger than what that batch fills (execute/cuda.py sizes them to the job).
  const int64_t capacity_bytes = pinned_in[0].numel();
  TORCH_CHECK(capacity_bytes >= 4, "staging buffers must hold at least one element");
  const at::Device device = device_in[0].device();
  TORCH_CHECK(device.is_cuda(), "staging device buffers must be CUDA tensors");
  for (size_t k = 0; k < slots_count; ++k) {
    check_staging_buffer(pinned_in[k], capacity_bytes, true, device);
    check_staging_buffer(pinned_out[k], capacity_bytes, true, device);
    check_staging_buffer(device_in[k], capacity_bytes, false, device);
    check_staging_buffer(device_out[k], capacity_bytes, false, device);
  }
  c10::cuda::CUDAGuard guard(device);
  std::vector<const unsigned char*> src;
  std::vector<unsigned char*> dst;
  std::vector<int64_t> source_bytes, destination_bytes;
  for (const auto& t : sources) {
    src.push_back(static_cast<const unsigned char*>(t.data_ptr()));
    source_bytes.push_back(t.numel());
  }
  for (const auto& t : destinations) {
    dst.push_back(static_cast<unsigned char*>(t.data_ptr()));
    destination_bytes.push_back(t.numel());
  }

  std::vector<Slot> slots;
  for (size_t k = 0; k < slots_count; ++k) {
    slots.push_back(Slot{static_cast<unsigned char*>(pinned_in[k].data_ptr()), static_cast<unsigned char*>(pinned_out[k].data_ptr()),
                         static_cast<unsigned char*>(device_in[k].data_ptr()), static_cast<unsigned char*>(device_out[k].data_ptr()),
                         c10::cuda::getStreamFromPool(false, device.index()), at::cuda::CUDAEvent()});
  }
  DrainSlots drain(slots);  // from here on, any exception leaves only after every stream is idle

  const int64_t* rows = plan.data_ptr<int64_t>();
  std::vector<int64_t> identity_rows;  // copied whole, kColumns values per row
  size_t current = 0;
  int64_t filled = 0, slot_from = -1, slot_to = -1;
  auto flush = [&]() {
    if (filled == 0) return;
    launch(slots[current], slot_from, slot_to, filled);
    current = (current + 1) % slots_count;
    unpack(slots[current]);  // the next slot to fill: wait for its previous batch and write it out
    filled = 0;
  };
  for (int64_t r = 0; r < plan.size(0); ++r) {
    const int64_t* row = rows + r * kColumns;
    if (row[kSourceCode] == row[kTargetCode]) {  // plain copies never visit the GPU
      identity_rows.insert(identity_rows.end(), row, row + kColumns);
      continue;
    }
    const int64_t from = row[kSourceCode], to = row[kTargetCode];
    const int64_t in = row[kSourceItemsize], out = row[kTargetItemsize];
    const int64_t capacity = capacity_bytes / std::max(in, out);  // elements of this pair a slot holds
    if (from != slot_from || to != slot_to) {
      flush();
      slot_from = from;
      slot_to = to;
    }
    for (int64_t run = 0; run < row[kRuns]; ++run) {
      const unsigned char* s = src[row[kSource]] + (row[kSourceOffset] + run * row[kSourceStride]) * in;
      unsigned char* d = dst[row[kDestination]] + (row[kTargetOffset] + run * row[kTargetStride]) * out;
      for (int64_t done = 0; done < row[kCount];) {
        if (filled == capacity) flush();
        const int64_t n = std::min(row[kCount] - done, capacity - filled);
        slots[current].pieces.push_back({s + done * in, d + done * out, n, filled});
        filled += n;
        done += n;
      }
    }
  }
  flush();

  // Plain copies on the CPU threads (not worth a trip to the device), while the GPU finishes the
  // last batches; then those batches are written out.
  if (!identity_rows.empty()) {
    try {
      gather_convert(src, source_bytes, dst, destination_bytes, identity_rows.data(),
                     int64_t(identity_rows.size()) / kColumns, aten_threads());
    } catch (const c10::Error&) {
      throw;
    } catch (const std::exception& e) {
      TORCH_CHECK(false, e.what());
    }
  }
  for (auto& slot : slots) unpack(slot);
}

}  // namespace

// The schemas are in ops.cpp. The staged op takes CPU views and CUDA buffers together; dispatch picks the CUDA kernel.
TORCH_LIBRARY_IMPL(fsdpfast, CUDA, m) {
  m.impl("gather_convert", &gather_convert_cuda);
  m.impl("gather_convert_staged", &gather_convert_staged);
}

}  // namespace fsdpfast
