// The common case of fsdpfast/plan/checks.py's check_extents, for plans of a million extents.
//
// The Python check is the reference and says what is wrong; this only answers "these extents
// surely tile the tensor", for the shape most plans have: single runs (Shard(0), whole tensors).
// Anything else (a strided extent, an arithmetic overflow, any failed test) answers "not sure",
// and the caller runs the Python check, which accepts what is right and names what is wrong.
#pragma once
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace fsdpfast {

// Extent records as plan/model.py's Extent lays its fields out in plan/columns.py's Records.
enum ExtentField : int64_t {
  kExtentSource = 0,
  kExtentSrcOffset,
  kExtentCount,
  kExtentDstOffset,
  kExtentRuns,
  kExtentSrcStride,
  kExtentDstStride,
  kExtentFields
};

// True if the `n` extents (rows of kExtentFields) are single runs inside their source buffers
// (`source_bytes`, `sources` of them) and inside a tensor of `total` elements of `itemsize`
// bytes, no two write one element, and together they write all `total`.
inline bool single_runs_tile(const int64_t* extents, int64_t n, const int64_t* source_bytes, int64_t sources,
                             int64_t total, int64_t itemsize) {
  std::vector<std::pair<int64_t, int64_t>> spans;  // [start, end) in the tensor
  spans.reserve(size_t(n));
  bool sorted = true;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* e = extents + i * kExtentFields;
    for (int64_t f = kExtentSrcOffset; f < kExtentFields; ++f)  // the source is checked below, as in Python
      if (e[f] < 0) return false;
    if (e[kExtentRuns] == 0 || e[kExtentCount] == 0) continue;  // writes nothing
    if (e[kExtentRuns] != 1) return false;
    int64_t end, src_end, src_bytes;
    if (__builtin_add_overflow(e[kExtentDstOffset], e[kExtentCount], &end) || end > total) return false;
    if (e[kExtentSource] < 0 || e[kExtentSource] >= sources) return false;
    if (__builtin_add_overflow(e[kExtentSrcOffset], e[kExtentCount], &src_end) ||
        __builtin_mul_overflow(src_end, itemsize, &src_bytes) || src_bytes > source_bytes[e[kExtentSource]])
      return false;
    if (!spans.empty() && e[kExtentDstOffset] < spans.back().first) sorted = false;
    spans.emplace_back(e[kExtentDstOffset], end);
  }
  if (!sorted) std::sort(spans.begin(), spans.end());
  int64_t reached = 0;  // every element below it written once; no gap allowed either
  for (const auto& span : spans) {
    if (span.first != reached) return false;
    reached = span.second;
  }
  return reached == total;
}

}  // namespace fsdpfast
