// CUDA implementations: gather_convert on device tensors, and the staged pipeline that merges
// CPU-resident (memory-mapped) shards through pinned buffers and the GPU.
//
// Pipeline per staging slot k (of at least two): the CPU packs pieces of extents into pinned
// buffer k, stream k copies them to the device, converts them and copies them back, and an event
// marks slot k done. While the GPU works on slot k the CPU already packs slot k+1 and unpacks
// the finished slot k-1 into the output views, so reading, converting and writing overlap.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "../convert.h"
#include "../plan_rows.h"
#include "../torch_plan.h"

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
  TORCH_CHECK(false, "unsupported conversion ", from, " -> ", to);
}

// --- gather_convert on device-resident views: one block per task ---

__global__ void gather_convert_kernel(const int64_t* __restrict__ rows, const int64_t* __restrict__ tasks,
                                      unsigned char* const* sources, unsigned char* const* destinations) {
  const int64_t* task = tasks + blockIdx.x * 5;
  const int64_t* row = rows + task[0] * kColumns;
  const int64_t in = row[kSourceItemsize], out = row[kTargetItemsize];
  const int64_t from = row[kSourceCode], to = row[kTargetCode];
  for (int64_t run = task[1]; run < task[2]; ++run) {
    const unsigned char* src = sources[row[kSource]] + (row[kSourceOffset] + run * row[kSourceStride]) * in;
    unsigned char* dst = destinations[row[kDestination]] + (row[kTargetOffset] + run * row[kTargetStride]) * out;
    for (int64_t i = task[3] + threadIdx.x; i < task[4]; i += blockDim.x) {
      if (from == to) {
        for (int64_t b = 0; b < in; ++b) dst[i * out + b] = src[i * in + b];
      } else {
        convert_element(from, to, src + i * in, dst + i * out);
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
  std::vector<int64_t> flat_tasks;
  for (const auto& t : tasks) flat_tasks.insert(flat_tasks.end(), {t.row, t.run_begin, t.run_end, t.elem_begin, t.elem_end});
  auto options = at::TensorOptions().dtype(at::kLong);
  auto to_device = [&](const std::vector<int64_t>& v) {
    return at::from_blob(const_cast<int64_t*>(v.data()), {int64_t(v.size())}, options).to(device);
  };
  auto d_rows = plan.to(device);
  auto d_tasks = to_device(flat_tasks);
  auto d_sources = to_device(device_pointers(sources, device));
  auto d_destinations = to_device(device_pointers(destinations, device));
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

void unpack(Slot& slot) {
  if (!slot.busy) return;
  slot.done.synchronize();
  const int64_t size = slot.out_itemsize;
  at::parallel_for(0, int64_t(slot.pieces.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Piece& p = slot.pieces[i];
      std::memcpy(p.dst, slot.pinned_out + p.slot_offset * size, p.count * size);
    }
  });
  slot.pieces.clear();
  slot.busy = false;
}

void launch(Slot& slot, int64_t from, int64_t to, int64_t elements) {
  const int64_t in = from == kFloat32 ? 4 : 2, out = to == kFloat32 ? 4 : 2;
  at::parallel_for(0, int64_t(slot.pieces.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Piece& p = slot.pieces[i];
      std::memcpy(slot.pinned_in + p.slot_offset * in, p.src, p.count * in);
    }
  });
  cudaStream_t s = slot.stream.stream();
  C10_CUDA_CHECK(cudaMemcpyAsync(slot.device_in, slot.pinned_in, elements * in, cudaMemcpyHostToDevice, s));
  launch_convert(from, to, slot.device_in, slot.device_out, elements, s);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  C10_CUDA_CHECK(cudaMemcpyAsync(slot.pinned_out, slot.device_out, elements * out, cudaMemcpyDeviceToHost, s));
  slot.done.record(slot.stream);
  slot.out_itemsize = out;
  slot.busy = true;
}

void gather_convert_staged(at::TensorList sources, at::TensorList destinations, const at::Tensor& plan,
                           at::TensorList pinned_in, at::TensorList pinned_out, at::TensorList device_in,
                           at::TensorList device_out) {
  check_plan_bounds(plan, sources, destinations);
  const size_t slots_count = pinned_in.size();
  TORCH_CHECK(slots_count >= 2 && pinned_out.size() == slots_count && device_in.size() == slots_count &&
                  device_out.size() == slots_count,
              "gather_convert_staged needs at least two staging slots of four buffers each");
  const int64_t capacity_bytes = pinned_in[0].numel();  // input side; output buffers are twice as large
  for (size_t k = 0; k < slots_count; ++k) {
    TORCH_CHECK(pinned_in[k].is_pinned() && pinned_out[k].is_pinned(), "staging host buffers must be pinned");
    TORCH_CHECK(pinned_in[k].numel() == capacity_bytes && device_in[k].numel() == capacity_bytes &&
                    pinned_out[k].numel() >= 2 * capacity_bytes && device_out[k].numel() >= 2 * capacity_bytes,
                "staging buffers have inconsistent sizes");
  }
  const at::Device device = device_in[0].device();
  c10::cuda::CUDAGuard guard(device);
  std::vector<unsigned char*> src, dst;
  for (const auto& t : sources) src.push_back(static_cast<unsigned char*>(t.data_ptr()));
  for (const auto& t : destinations) dst.push_back(static_cast<unsigned char*>(t.data_ptr()));

  std::vector<Slot> slots;
  for (size_t k = 0; k < slots_count; ++k) {
    slots.push_back(Slot{static_cast<unsigned char*>(pinned_in[k].data_ptr()), static_cast<unsigned char*>(pinned_out[k].data_ptr()),
                         static_cast<unsigned char*>(device_in[k].data_ptr()), static_cast<unsigned char*>(device_out[k].data_ptr()),
                         c10::cuda::getStreamFromPool(false, device.index()), at::cuda::CUDAEvent()});
  }

  const int64_t* rows = plan.data_ptr<int64_t>();
  std::vector<int64_t> identity_rows;
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
      identity_rows.push_back(r);
      continue;
    }
    const int64_t from = row[kSourceCode], to = row[kTargetCode];
    const int64_t in = row[kSourceItemsize], out = row[kTargetItemsize];
    const int64_t capacity = capacity_bytes / 4;  // elements: fits float32 in, and out at twice the bytes
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
  for (auto& slot : slots) unpack(slot);

  // Identity rows: straight CPU copies (they were not worth a trip to the device).
  at::parallel_for(0, int64_t(identity_rows.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t* row = rows + identity_rows[i] * kColumns;
      const int64_t size = row[kSourceItemsize];
      for (int64_t run = 0; run < row[kRuns]; ++run) {
        std::memcpy(dst[row[kDestination]] + (row[kTargetOffset] + run * row[kTargetStride]) * size,
                    src[row[kSource]] + (row[kSourceOffset] + run * row[kSourceStride]) * size, row[kCount] * size);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fsdpfast, m) {
  m.def(
      "gather_convert_staged(Tensor[] sources, Tensor(a!)[] destinations, Tensor plan, Tensor(b!)[] pinned_in, "
      "Tensor(c!)[] pinned_out, Tensor(d!)[] device_in, Tensor(e!)[] device_out) -> ()");
}

// The staged op takes CPU views and CUDA buffers together; dispatch picks the CUDA kernel.
TORCH_LIBRARY_IMPL(fsdpfast, CUDA, m) {
  m.impl("gather_convert", &gather_convert_cuda);
  m.impl("gather_convert_staged", &gather_convert_staged);
}

}  // namespace fsdpfast
