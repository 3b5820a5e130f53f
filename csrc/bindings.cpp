// fsdpfast._native: the CPU kernels for Python without torch.
//
// A merge with the native CPU engine reads metadata with the restricted unpickler and moves
// bytes with these functions, so it never pays for importing torch. Arguments are Python
// buffers (mmap views, array('q') plans); the GIL is released while the kernels run.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <vector>

#include "crc32c.h"
#include "kernels.h"
#include "pickle_scan.h"
#include "plan_checks.h"
#include "plan_rows.h"
#include "transpose.h"

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

// Pointers to and sizes of a list of buffers; `held` keeps every view alive while the kernels run.
std::vector<const unsigned char*> byte_views(const std::vector<py::buffer>& buffers, std::vector<int64_t>& bytes,
                                             std::vector<py::buffer_info>& held) {
  std::vector<const unsigned char*> pointers;
  for (const auto& buffer : buffers) {
    held.push_back(buffer.request());
    pointers.push_back(static_cast<const unsigned char*>(held.back().ptr));
    bytes.push_back(int64_t(held.back().size * held.back().itemsize));
  }
  return pointers;
}

Int64Array plan_rows(const py::buffer& plan) {
  Int64Array rows = int64_array(plan, "plan");
  if (rows.size % fsdpfast::kColumns != 0) throw std::invalid_argument("plan length is not a multiple of the row width");
  return rows;
}

std::vector<uint32_t> gather_convert_to_file(const std::vector<py::buffer>& sources, const py::buffer& plan, const py::buffer& offsets,
                                             const py::buffer& sizes, int fd, int64_t chunk_bytes, int threads, bool release_sources) {
  std::vector<int64_t> bytes;
  std::vector<py::buffer_info> held;
  const auto pointers = byte_views(sources, bytes, held);
  Int64Array rows = plan_rows(plan), off = int64_array(offsets, "offsets"), size = int64_array(sizes, "sizes");
  if (off.size != size.size) throw std::invalid_argument("offsets and sizes differ in length");
  py::gil_scoped_release unlocked;
  return fsdpfast::gather_convert_to_file(pointers, bytes, rows.data, rows.size / fsdpfast::kColumns, off.data, size.data,
                                          off.size, fd, chunk_bytes, fsdpfast::thread_pool_for(threads), release_sources);
}

py::tuple gather_convert_compare(const std::vector<py::buffer>& sources, const py::buffer& plan, const std::vector<py::buffer>& expected,
                                 int64_t chunk_bytes, int threads, bool release_sources) {
  std::vector<int64_t> bytes, expected_bytes;
  std::vector<py::buffer_info> held;
  const auto pointers = byte_views(sources, bytes, held);
  const auto wanted = byte_views(expected, expected_bytes, held);
  Int64Array rows = plan_rows(plan);
  std::vector<int64_t> first(wanted.size(), -1);
  std::vector<uint32_t> crcs;
  {
    py::gil_scoped_release unlocked;
    crcs = fsdpfast::gather_convert_compare(pointers, bytes, rows.data, rows.size / fsdpfast::kColumns, wanted,
                                            expected_bytes.data(), chunk_bytes, fsdpfast::thread_pool_for(threads),
                                            first.data(), release_sources);
  }
  return py::make_tuple(crcs, first);
}

py::object pickle_not_plain(const py::buffer& data) {
  py::buffer_info info = data.request();
  const char* why = fsdpfast::pickle_not_plain(static_cast<const unsigned char*>(info.ptr), size_t(info.size * info.itemsize));
  return why == nullptr ? py::object(py::none()) : py::object(py::str(why));
}

py::object pickle_value_changes(const py::buffer& first, const py::buffer& other) {
  py::buffer_info a = first.request(), b = other.request();
  std::vector<size_t> changes;
  if (!fsdpfast::pickle_value_changes(static_cast<const unsigned char*>(a.ptr), size_t(a.size * a.itemsize),
                                      static_cast<const unsigned char*>(b.ptr), size_t(b.size * b.itemsize), changes))
    return py::none();
  return py::cast(changes);
}

uint32_t crc32c(const py::buffer& data, uint32_t crc) {
  py::buffer_info info = data.request();
  const size_t n = size_t(info.size * info.itemsize);
  py::gil_scoped_release unlocked;
  return fsdpfast::crc32c(crc, info.ptr, n);
}

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
  return fsdpfast::crc32c_combine(crc_a, crc_b, length_b);
}

// The CRC-32C of `total` bytes that hold runs (starts[i], lengths[i]) whose CRCs are crcs[i], in
// increasing order, and zeros elsewhere: what a rank that wrote a column block (one run per row)
// sends for the tensor. Appending n bytes multiplies the register by x^(8n); the shifts of the
// last gap and run lengths are kept, so a block of equal rows costs two multiplications per row.
uint32_t crc32c_spread(const py::buffer& starts, const py::buffer& lengths, const py::buffer& crcs, uint64_t total) {
  namespace d = fsdpfast::crc32c_detail;
  Int64Array start = int64_array(starts, "starts"), length = int64_array(lengths, "lengths"), crc_of = int64_array(crcs, "crcs");
  if (start.size != length.size || start.size != crc_of.size) throw std::invalid_argument("starts, lengths and crcs differ in length");
  py::gil_scoped_release unlocked;
  uint64_t at = 0, gap_seen = 0, run_seen = 0;
  uint32_t crc = 0, gap_shift = d::shift_of(0), gap_zeros = 0, run_shift = d::shift_of(0);
  auto zeros = [&](uint64_t n) {  // append n zero bytes
    if (n != gap_seen) gap_seen = n, gap_shift = d::shift_of(n), gap_zeros = ~d::multiply(0xFFFFFFFFu, gap_shift);
    crc = d::multiply(crc, gap_shift) ^ gap_zeros;
  };
  for (int64_t i = 0; i < start.size; ++i) {
    const uint64_t begin = uint64_t(start.data[i]), n = uint64_t(length.data[i]);
    if (start.data[i] < 0 || length.data[i] < 0 || begin < at || begin + n > total)
      throw std::invalid_argument("runs must be in order, apart, and inside the tensor");
    if (begin > at) zeros(begin - at);
    if (n != run_seen) run_seen = n, run_shift = d::shift_of(n);
    crc = d::multiply(crc, run_shift) ^ uint32_t(crc_of.data[i]);
    at = begin + n;
  }
  if (total > at) zeros(total - at);
  return crc;
}

// The common case of plan/checks.py's check, natively (csrc/plan_checks.h); False: not sure.
bool extents_tile(const py::buffer& extents, const py::buffer& source_bytes, int64_t total, int64_t itemsize) {
  Int64Array rows = int64_array(extents, "extents"), sizes = int64_array(source_bytes, "source_bytes");
  if (rows.size % fsdpfast::kExtentFields != 0) throw std::invalid_argument("extents length is not a multiple of 7");
  if (total < 0 || itemsize <= 0) return false;
  py::gil_scoped_release unlocked;
  return fsdpfast::single_runs_tile(rows.data, rows.size / fsdpfast::kExtentFields, sizes.data, sizes.size, total, itemsize);
}

// transpose.h's transposed copy between two buffers; their sizes are checked against the shape asked.
void transpose_convert(const py::buffer& source, const py::buffer& destination, int64_t batch, int64_t rows, int64_t cols,
                       int64_t from, int64_t to, int64_t in, int64_t out, int threads) {
  py::buffer_info s = source.request(), d = destination.request(true);
  if (batch < 0 || rows < 0 || cols < 0 || in <= 0 || out <= 0) throw std::invalid_argument("transpose_convert: bad sizes");
  if (int64_t(s.size * s.itemsize) < batch * rows * cols * in || int64_t(d.size * d.itemsize) < batch * rows * cols * out)
    throw std::invalid_argument("transpose_convert: a buffer is smaller than the matrices");
  py::gil_scoped_release unlocked;
  fsdpfast::transpose_convert(static_cast<const unsigned char*>(s.ptr), static_cast<unsigned char*>(d.ptr), batch, rows, cols, from,
                              to, in, out, fsdpfast::thread_pool_for(threads));
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "fsdpfast CPU kernels without torch";
  m.attr("COLUMNS") = int64_t(fsdpfast::kColumns);
  m.def("gather_convert_to_file", &gather_convert_to_file, py::arg("sources"), py::arg("plan"), py::arg("offsets"),
        py::arg("sizes"), py::arg("fd"), py::arg("chunk_bytes"), py::arg("threads") = 0, py::arg("release_sources") = false,
        "Execute plan rows from source buffers into file `fd` at the destinations' offsets. release_sources: the "
        "sources are read-only file mappings whose pages may be dropped once read (never for ordinary memory). "
        "Returns each destination's CRC-32C.");
  m.def("gather_convert_compare", &gather_convert_compare, py::arg("sources"), py::arg("plan"), py::arg("expected"),
        py::arg("chunk_bytes"), py::arg("threads") = 0, py::arg("release_sources") = false,
        "Recompute plan rows chunk by chunk and compare with the `expected` buffers (one per destination) without "
        "holding any destination whole. Returns (CRC-32C per destination, first differing byte per destination or -1).");
  m.def("pickle_not_plain", &pickle_not_plain, py::arg("data"),
        "None if the C unpickler may read this pickle (csrc/pickle_scan.h), else why not.");
  m.def("pickle_value_changes", &pickle_value_changes, py::arg("first"), py::arg("other"),
        "The offsets in `first` of the opcodes whose number or string value differs in `other`, if the two plain "
        "pickles differ in nothing else (csrc/pickle_scan.h); else None.");
  m.def("extents_tile", &extents_tile, py::arg("extents"), py::arg("source_bytes"), py::arg("total"), py::arg("itemsize"),
        "True if the extents (int64 rows of 7: plan.model.Extent's fields) are single runs inside their source "
        "buffers (bytes each) that write each of the tensor's `total` elements exactly once; False means not sure "
        "(csrc/plan_checks.h): plan/checks.py's check then decides.");
  m.def("transpose_convert", &transpose_convert, py::arg("source"), py::arg("destination"), py::arg("batch"), py::arg("rows"),
        py::arg("cols"), py::arg("source_code"), py::arg("target_code"), py::arg("source_itemsize"), py::arg("target_itemsize"),
        py::arg("threads") = 0,
        "destination[b][c][r] = source[b][r][c] (csrc/transpose.h), converted between the element codes (equal codes: a copy).");
  m.def("crc32c", &crc32c, py::arg("data"), py::arg("crc") = 0,
        "CRC-32C of a buffer, continuing from `crc` (the CRC of the bytes before it).");
  m.def("crc32c_spread", &crc32c_spread, py::arg("starts"), py::arg("lengths"), py::arg("crcs"), py::arg("total"),
        "CRC-32C of `total` bytes holding runs at `starts` of `lengths` bytes with CRC-32Cs `crcs` (int64 buffers, "
        "runs in order) and zeros elsewhere.");
  m.def("crc32c_combine", &crc32c_combine, py::arg("crc_a"), py::arg("crc_b"), py::arg("length_b"),
        "CRC-32C of A followed by B, from crc(A), crc(B) and B's length in bytes.");
}
