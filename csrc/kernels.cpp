// The CPU kernels: gather pieces of shards, convert element types, write them in place.
#include "kernels.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>

#include "convert.h"
#include "crc32c.h"
#include "plan_rows.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FSDPFAST_X86 1
#endif

namespace fsdpfast {
namespace {

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

std::string row_name(int64_t r) { return "plan row " + std::to_string(r); }

void convert_f32_to_bf16(const uint32_t* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);  // branch-free: the compiler vectorises it
}

#ifdef FSDPFAST_X86
// The F16C instructions give exactly the software results of convert.h, only faster.
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

void copy_or_convert(const int64_t* row, const unsigned char* src, unsigned char* dst, int64_t n) {
  if (row[kSourceCode] == row[kTargetCode]) {
    std::memcpy(dst, src, size_t(n * row[kSourceItemsize]));
  } else {
    convert_run(row[kSourceCode], row[kTargetCode], src, dst, n);
  }
}

void run_task(const Task& task, const int64_t* rows, const std::vector<const unsigned char*>& sources,
              const std::vector<unsigned char*>& destinations) {
  const int64_t* row = rows + task.row * kColumns;
  const int64_t in = row[kSourceItemsize], out = row[kTargetItemsize];
  const int64_t n = task.elem_end - task.elem_begin;
  for (int64_t run = task.run_begin; run < task.run_end; ++run) {
    const unsigned char* src = sources[row[kSource]] + (row[kSourceOffset] + run * row[kSourceStride] + task.elem_begin) * in;
    unsigned char* dst = destinations[row[kDestination]] + (row[kTargetOffset] + run * row[kTargetStride] + task.elem_begin) * out;
    copy_or_convert(row, src, dst, n);
  }
}

void write_all(int fd, const unsigned char* data, int64_t size, int64_t offset) {
  while (size > 0) {
    ssize_t n = ::pwrite(fd, data, size_t(size), off_t(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw std::system_error(n < 0 ? errno : EIO, std::generic_category(), "writing the output file");
    data += n;
    size -= n;
    offset += n;
  }
}

// Drop the whole pages inside [data, data + size) of a file mapping from this process.
void release_pages(const unsigned char* data, int64_t size) {
  static const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + uintptr_t(size)) & ~(page - 1);
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

// Source bytes converted between two releases of their pages (below: convert_and_release).
constexpr int64_t kReleaseSliceBytes = int64_t(2) << 20;

// Convert n elements from a file mapping, dropping the source pages slice by slice as they are
// read: the pages a thread holds mapped stay about one slice, whatever the run's length. A slice
// ends at the first element boundary at or past a slice-aligned source address: exactly on it
// when the source is element-aligned (torch.save storages are 64-byte aligned), so every page is
// dropped. Otherwise the element straddling that address leaves its page partly in both slices,
// and release_pages, which drops whole pages only, keeps it: one page per slice stays mapped.
void convert_and_release(const int64_t* row, const unsigned char* src, unsigned char* dst, int64_t n) {
  const int64_t in = row[kSourceItemsize], out = row[kTargetItemsize], slice = kReleaseSliceBytes;
  for (int64_t done = 0; done < n;) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(src + done * in);
    const uintptr_t boundary = (at / uintptr_t(slice) + 1) * uintptr_t(slice);
    const int64_t m = std::min<int64_t>(n - done, int64_t((boundary - at + uintptr_t(in) - 1) / uintptr_t(in)));
    copy_or_convert(row, src + done * in, dst + done * out, m);
    release_pages(src + done * in, m * in);
    done += m;
  }
}

// Fill elements [first, last) of a destination from the rows that land there; returns how many
// elements were written, so a chunk with a gap is caught before it reaches the file.
int64_t fill_chunk(const std::vector<const int64_t*>& rows, int64_t first, int64_t last, unsigned char* buffer,
                   const std::vector<const unsigned char*>& sources, bool release_sources) {
  int64_t written = 0;
  for (const int64_t* row : rows) {
    const int64_t count = row[kCount], runs = row[kRuns], in = row[kSourceItemsize], out = row[kTargetItemsize];
    const int64_t start = row[kTargetOffset], stride = runs > 1 ? row[kTargetStride] : count;
    if (count == 0 || runs == 0 || start >= last || start + (runs - 1) * stride + count <= first) continue;
    for (int64_t run = first > start + count ? (first - start - count) / stride + 1 : 0; run < runs; ++run) {
      const int64_t run_start = start + run * stride;
      if (run_start >= last) break;
      const int64_t lo = std::max(first, run_start), hi = std::min(last, run_start + count);
      if (lo >= hi) continue;
      const unsigned char* src = sources[row[kSource]] + (row[kSourceOffset] + run * row[kSourceStride] + (lo - run_start)) * in;
      if (release_sources) {
        convert_and_release(row, src, buffer + (lo - first) * out, hi - lo);
      } else {
        copy_or_convert(row, src, buffer + (lo - first) * out, hi - lo);
      }
      written += hi - lo;
    }
  }
  return written;
}

}  // namespace

void check_bounds(const int64_t* row, int64_t r, int64_t source_bytes, int64_t target_bytes) {
  if (row[kRuns] == 0 || row[kCount] == 0) return;
  const int64_t last_run = row[kRuns] - 1;
  const int64_t src_end = (row[kSourceOffset] + last_run * row[kSourceStride] + row[kCount]) * row[kSourceItemsize];
  const int64_t dst_end = (row[kTargetOffset] + last_run * row[kTargetStride] + row[kCount]) * row[kTargetItemsize];
  if (src_end > source_bytes) fail(row_name(r) + " reads past its source (" + std::to_string(src_end) + " > " + std::to_string(source_bytes) + ")");
  if (dst_end > target_bytes) fail(row_name(r) + " writes past its destination (" + std::to_string(dst_end) + " > " + std::to_string(target_bytes) + ")");
}

ParallelFor thread_pool_for(int threads) {
  if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
  return [threads](int64_t n, const std::function<void(int64_t, int64_t)>& body) {
    const int64_t workers = std::min<int64_t>(threads, n);
    if (workers <= 1) {
      if (n > 0) body(0, n);
      return;
    }
    // Pieces handed out one at a time: chunks of unequal cost still finish together.
    std::atomic<int64_t> next{0};
    std::exception_ptr error;
    std::atomic<bool> failed{false};
    auto work = [&]() {
      try {
        for (int64_t i = next++; i < n && !failed; i = next++) body(i, i + 1);
      } catch (...) {
        if (!failed.exchange(true)) error = std::current_exception();
      }
    };
    std::vector<std::thread> pool;
    for (int64_t t = 1; t < workers; ++t) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
    if (error) std::rethrow_exception(error);
  };
}

void check_rows(const int64_t* rows, int64_t n, size_t sources, size_t destinations) {
  for (int64_t r = 0; r < n; ++r) {
    const int64_t* row = rows + r * kColumns;
    if (row[kSource] < 0 || size_t(row[kSource]) >= sources) fail(row_name(r) + ": bad source index");
    if (row[kDestination] < 0 || size_t(row[kDestination]) >= destinations) fail(row_name(r) + ": bad destination index");
    if (row[kCount] < 0 || row[kRuns] < 0 || row[kSourceOffset] < 0 || row[kTargetOffset] < 0)
      fail(row_name(r) + ": negative size or offset");
    if (row[kRuns] > 1 && (row[kTargetStride] < row[kCount] || row[kSourceStride] < 0))
      fail(row_name(r) + ": runs overlap in the destination");
    const bool same = row[kSourceCode] == row[kTargetCode];
    const bool ok = same ? row[kSourceItemsize] == row[kTargetItemsize] && row[kSourceItemsize] > 0
                         : row[kSourceCode] != kOther && row[kTargetCode] != kOther;
    if (!ok) fail(row_name(r) + ": unsupported conversion");
    if (!same && (row[kSourceItemsize] != (row[kSourceCode] == kFloat32 ? 4 : 2) ||
                  row[kTargetItemsize] != (row[kTargetCode] == kFloat32 ? 4 : 2)))
      fail(row_name(r) + ": element sizes do not match the element codes");
  }
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
  // Between the 16-bit kinds: blocks widened to float32 bits, then narrowed, with the vector paths.
  auto s = reinterpret_cast<const uint16_t*>(src);
  auto d = reinterpret_cast<uint16_t*>(dst);
  uint32_t wide[1024];
  for (int64_t start = 0; start < n; start += 1024) {
    const int64_t m = std::min<int64_t>(1024, n - start);
    if (from == kBFloat16) {
      for (int64_t i = 0; i < m; ++i) wide[i] = bf16_to_f32(s[start + i]);
      convert_f32_to_f16(wide, d + start, m);
    } else {
      convert_f16_to_f32(s + start, wide, m);
      for (int64_t i = 0; i < m; ++i) d[start + i] = widened_f16_to_bf16(wide[i]);
    }
  }
}

void gather_convert(const std::vector<const unsigned char*>& sources, const std::vector<int64_t>& source_bytes,
                    const std::vector<unsigned char*>& destinations, const std::vector<int64_t>& destination_bytes,
                    const int64_t* rows, int64_t n, const ParallelFor& parallel_for) {
  check_rows(rows, n, sources.size(), destinations.size());
  for (int64_t r = 0; r < n; ++r) {
    const int64_t* row = rows + r * kColumns;
    check_bounds(row, r, source_bytes[row[kSource]], destination_bytes[row[kDestination]]);
  }
  const auto tasks = split_tasks(rows, n, int64_t(1) << 16);
  parallel_for(int64_t(tasks.size()), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) run_task(tasks[i], rows, sources, destinations);
  });
}

namespace {

// Validate the rows, cut every destination into chunks, and hand each filled chunk to
// `sink(destination, begin, data, size)` from the worker threads. Returns each destination's
// CRC-32C: the chunks' CRCs, taken while they are hot in cache, combined in order.
template <typename Sink>
std::vector<uint32_t> for_each_chunk(const std::vector<const unsigned char*>& sources, const std::vector<int64_t>& source_bytes,
                                     const int64_t* rows, int64_t n, const int64_t* sizes, int64_t destinations,
                                     int64_t chunk_bytes, const ParallelFor& parallel_for, bool release_sources,
                                     const Sink& sink) {
  if (chunk_bytes < 64 || chunk_bytes % 8 != 0) fail("chunk_bytes must be a multiple of 8, at least 64");
  check_rows(rows, n, sources.size(), size_t(destinations));
  std::vector<std::vector<const int64_t*>> rows_of(static_cast<size_t>(destinations));
  std::vector<int64_t> itemsize_of(static_cast<size_t>(destinations), 0);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t* row = rows + r * kColumns;
    const int64_t d = row[kDestination];
    check_bounds(row, r, source_bytes[row[kSource]], sizes[d]);
    if (itemsize_of[d] != 0 && itemsize_of[d] != row[kTargetItemsize]) fail(row_name(r) + ": a destination written with two element sizes");
    itemsize_of[d] = row[kTargetItemsize];
    rows_of[d].push_back(row);
  }
  struct Chunk {
    int64_t destination, begin, end;  // bytes within the destination
  };
  std::vector<Chunk> chunks;
  for (int64_t d = 0; d < destinations; ++d) {
    if (sizes[d] > 0 && itemsize_of[d] == 0) fail("destination " + std::to_string(d) + " has no rows to fill it");
    for (int64_t begin = 0; begin < sizes[d]; begin += chunk_bytes) chunks.push_back({d, begin, std::min(sizes[d], begin + chunk_bytes)});
  }
  std::vector<uint32_t> chunk_crc(chunks.size());
  parallel_for(int64_t(chunks.size()), [&](int64_t begin, int64_t end) {
    thread_local std::vector<unsigned char> buffer;
    if (int64_t(buffer.size()) < chunk_bytes) buffer.resize(size_t(chunk_bytes));
    for (int64_t i = begin; i < end; ++i) {
      const Chunk& c = chunks[i];
      const int64_t size = itemsize_of[c.destination];
      const int64_t first = c.begin / size, last = c.end / size;
      const int64_t written = fill_chunk(rows_of[c.destination], first, last, buffer.data(), sources, release_sources);
      if (written != last - first)
        fail("the plan leaves a gap in destination " + std::to_string(c.destination) + ": " + std::to_string(written) +
             " of " + std::to_string(last - first) + " elements");
      chunk_crc[i] = crc32c(0, buffer.data(), size_t(c.end - c.begin));
      sink(c.destination, c.begin, buffer.data(), c.end - c.begin);
    }
  });
  std::vector<uint32_t> crcs(static_cast<size_t>(destinations), 0);
  for (size_t i = 0; i < chunks.size(); ++i) {
    const Chunk& c = chunks[i];
    crcs[c.destination] = crc32c_combine(crcs[c.destination], chunk_crc[i], uint64_t(c.end - c.begin));
  }
  return crcs;
}

}  // namespace

std::vector<uint32_t> gather_convert_to_file(const std::vector<const unsigned char*>& sources, const std::vector<int64_t>& source_bytes,
                                             const int64_t* rows, int64_t n, const int64_t* offsets, const int64_t* sizes,
                                             int64_t destinations, int fd, int64_t chunk_bytes, const ParallelFor& parallel_for,
                                             bool release_sources) {
  return for_each_chunk(sources, source_bytes, rows, n, sizes, destinations, chunk_bytes, parallel_for, release_sources,
                        [&](int64_t d, int64_t begin, const unsigned char* data, int64_t size) {
                          write_all(fd, data, size, offsets[d] + begin);
                        });
}

std::vector<uint32_t> gather_convert_compare(const std::vector<const unsigned char*>& sources, const std::vector<int64_t>& source_bytes,
                                             const int64_t* rows, int64_t n, const std::vector<const unsigned char*>& expected,
                                             const int64_t* sizes, int64_t chunk_bytes, const ParallelFor& parallel_for,
                                             int64_t* first_difference, bool release_sources) {
  const int64_t destinations = int64_t(expected.size());
  std::vector<std::atomic<int64_t>> first(static_cast<size_t>(destinations));
  for (auto& f : first) f = -1;
  auto crcs = for_each_chunk(sources, source_bytes, rows, n, sizes, destinations, chunk_bytes, parallel_for, release_sources,
                             [&](int64_t d, int64_t begin, const unsigned char* data, int64_t size) {
                               const unsigned char* want = expected[d] + begin;
                               if (std::memcmp(data, want, size_t(size)) == 0) return;
                               int64_t at = 0;
                               while (data[at] == want[at]) ++at;
                               at += begin;
                               int64_t seen = first[d].load();  // keep the smallest offset any thread found
                               while ((seen < 0 || at < seen) && !first[d].compare_exchange_weak(seen, at)) {
                               }
                             });
  for (int64_t d = 0; d < destinations; ++d) first_difference[d] = first[d].load();
  return crcs;
}

}  // namespace fsdpfast
