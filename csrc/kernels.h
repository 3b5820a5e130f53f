// The CPU kernels, free of torch and Python: raw pointers in, bytes out.
//
// Both front ends use them: the torch ops (ops.cpp, threads from at::parallel_for) and the
// plain Python module _native (bindings.cpp, threads of its own), which lets a merge run
// without importing torch at all.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

namespace fsdpfast {

// parallel_for(n, body): run body(begin, end) over pieces of [0, n), possibly on many threads.
using ParallelFor = std::function<void(int64_t, const std::function<void(int64_t, int64_t)>&)>;

// A ParallelFor on `threads` threads of its own (0: one per processor available to us).
ParallelFor thread_pool_for(int threads);

// Validate plan rows against the number of sources and destinations; throws std::invalid_argument.
void check_rows(const int64_t* rows, int64_t n, size_t sources, size_t destinations);

// Bytes row `r` may touch, against the sizes of its source and destination; throws std::invalid_argument.
void check_bounds(const int64_t* row, int64_t r, int64_t source_bytes, int64_t target_bytes);

// Convert n elements between codes `from` and `to` (different float codes).
void convert_run(int64_t from, int64_t to, const unsigned char* src, unsigned char* dst, int64_t n);

// Every row from source byte views into destination byte views.
void gather_convert(const std::vector<const unsigned char*>& sources, const std::vector<int64_t>& source_bytes,
                    const std::vector<unsigned char*>& destinations, const std::vector<int64_t>& destination_bytes,
                    const int64_t* rows, int64_t n, const ParallelFor& parallel_for);

// Every row from source byte views into the file `fd`: destination d is the byte range
// [offsets[d], offsets[d] + sizes[d]). Chunks of each destination are assembled in per-thread
// buffers and written with pwrite; a chunk the rows do not fill completely is an error.
// release_sources: the sources are read-only mappings of files; drop their pages from this process
// every 512 KB as they are read (the page cache keeps them), so resident memory stays flat whatever the tensor sizes.
// Never set it for sources that are ordinary memory: dropping would zero them.
// Returns each destination's CRC-32C (crc32c.h), computed from the chunks as they are written.
std::vector<uint32_t> gather_convert_to_file(const std::vector<const unsigned char*>& sources, const std::vector<int64_t>& source_bytes,
                                             const int64_t* rows, int64_t n, const int64_t* offsets, const int64_t* sizes,
                                             int64_t destinations, int fd, int64_t chunk_bytes, const ParallelFor& parallel_for,
                                             bool release_sources = false);

// The same chunks, compared with `expected[d]` (sizes[d] bytes each) instead of written:
// first_difference[d] is the byte offset of the first difference in destination d, or -1.
// Returns each destination's CRC-32C of the recomputed bytes.
std::vector<uint32_t> gather_convert_compare(const std::vector<const unsigned char*>& sources, const std::vector<int64_t>& source_bytes,
                                             const int64_t* rows, int64_t n, const std::vector<const unsigned char*>& expected,
                                             const int64_t* sizes, int64_t chunk_bytes, const ParallelFor& parallel_for,
                                             int64_t* first_difference, bool release_sources = false);

}  // namespace fsdpfast
