// The plan the Python engines hand to the kernels: int64 rows of kColumns, one per extent.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

namespace fsdpfast {

enum Column : int64_t {
  kSource = 0,      // index into the sources list
  kDestination,     // index into the destinations list
  kSourceCode,      // Code of the source elements (convert.h)
  kTargetCode,      // Code of the destination elements
  kSourceItemsize,  // bytes per source element
  kTargetItemsize,  // bytes per destination element
  kSourceOffset,    // elements
  kCount,           // contiguous elements per run
  kTargetOffset,    // elements
  kRuns,
  kSourceStride,    // elements between run starts
  kTargetStride,
  kColumns
};

// A slice of work: runs [run_begin, run_end) of one row, elements [elem_begin, elem_end) of each.
struct Task {
  int64_t row, run_begin, run_end, elem_begin, elem_end;
};

// Split rows into tasks of about `chunk` elements: long runs are cut, short runs are grouped,
// so thousands of small tensors and one huge tensor both spread evenly over threads.
inline std::vector<Task> split_tasks(const int64_t* rows, int64_t n, int64_t chunk) {
  std::vector<Task> tasks;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t* row = rows + r * kColumns;
    int64_t count = row[kCount], runs = row[kRuns];
    if (count <= 0 || runs <= 0) continue;
    if (count >= chunk) {
      for (int64_t run = 0; run < runs; ++run)
        for (int64_t start = 0; start < count; start += chunk)
          tasks.push_back({r, run, run + 1, start, std::min(count, start + chunk)});
    } else {
      int64_t per_task = std::max<int64_t>(1, chunk / count);
      for (int64_t run = 0; run < runs; run += per_task)
        tasks.push_back({r, run, std::min(runs, run + per_task), 0, count});
    }
  }
  return tasks;
}

}  // namespace fsdpfast
