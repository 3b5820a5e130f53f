// fsdpfast._native: the CPU kernels for Python without torch.
//
// A merge with the native CPU engine reads metadata with the restricted unpickler and moves
// bytes with these functions, so it never pays for importing torch. Arguments are Python
// buffers (mmap views, array('q') plans); the GIL is released while the kernels run.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <vector>

#include "kernels.h"
#include "plan_rows.h"

namespace py = pybind11;

namespace {

struct Int64Array {
  const int64_t* data;
  int64_t size;
};

Int64Array int64_array(const py::buffer& buffer, const char* what) {
  py::buffer_info info = buffer.request();
  if (info.itemsize != 8 || (info.format != "q" && info.format != "l"))
    throw std::invalid_argument(std::string(what) + " must be a buffer of int64");
  return {static_cast<const int64_t*>(info.ptr), int64_t(info.size)};
}

void gather_convert_to_file(const std::vector<py::buffer>& sources, const py::buffer& plan, const py::buffer& offsets,
                            const py::buffer& sizes, int fd, int64_t chunk_bytes, int threads, bool release_sources) {
  std::vector<const unsigned char*> pointers;
  std::vector<int64_t> bytes;
  std::vector<py::buffer_info> held;  // keeps every view alive while the kernels run
  for (const auto& source : sources) {
    held.push_back(source.request());
    pointers.push_back(static_cast<const unsigned char*>(held.back().ptr));
    bytes.push_back(int64_t(held.back().size * held.back().itemsize));
  }
  Int64Array rows = int64_array(plan, "plan"), off = int64_array(offsets, "offsets"), size = int64_array(sizes, "sizes");
  if (rows.size % fsdpfast::kColumns != 0) throw std::invalid_argument("plan length is not a multiple of the row width");
  if (off.size != size.size) throw std::invalid_argument("offsets and sizes differ in length");
  py::gil_scoped_release unlocked;
  fsdpfast::gather_convert_to_file(pointers, bytes, rows.data, rows.size / fsdpfast::kColumns, off.data, size.data,
                                   off.size, fd, chunk_bytes, fsdpfast::thread_pool_for(threads), release_sources);
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "fsdpfast CPU kernels without torch";
  m.attr("COLUMNS") = int64_t(fsdpfast::kColumns);
  m.def("gather_convert_to_file", &gather_convert_to_file, py::arg("sources"), py::arg("plan"), py::arg("offsets"),
        py::arg("sizes"), py::arg("fd"), py::arg("chunk_bytes"), py::arg("threads") = 0, py::arg("release_sources") = false,
        "Execute plan rows from source buffers into file `fd` at the destinations' offsets. release_sources: the "
        "sources are read-only file mappings whose pages may be dropped once read (never for ordinary memory).");
}
