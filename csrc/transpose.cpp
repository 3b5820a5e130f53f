// The CPU transposed copy (transpose.h): square tiles small enough for the L1 cache, so that both the
// rows read and the columns written stay in cache while a tile is moved; a conversion is done a tile
// row at a time with the vectorised run converters (kernels.cpp), then the tile is transposed.
#include "transpose.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "convert.h"

namespace fsdpfast {
namespace {

constexpr int64_t kTile = 64;  // elements per tile side: 64 x 64 x 4 bytes = 16 KB, read and written in L1

// One tile: rows [r0, r1) x columns [c0, c1) of a matrix with `ld_src` elements per row, into a matrix with
// `ld_dst` elements per row, transposed. Eight destination rows at a time, so each source row read
// feeds eight write streams (the compiler unrolls and vectorises the fixed-width inner loop).
template <typename T>
void move_tile(const T* __restrict__ src, T* __restrict__ dst, int64_t r0, int64_t r1, int64_t c0, int64_t c1, int64_t ld_src,
               int64_t ld_dst) {
  int64_t c = c0;
  for (; c + 8 <= c1; c += 8) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* s = src + r * ld_src + c;
      for (int k = 0; k < 8; ++k) dst[(c + k) * ld_dst + r] = s[k];
    }
  }
  for (; c < c1; ++c)
    for (int64_t r = r0; r < r1; ++r) dst[c * ld_dst + r] = src[r * ld_src + c];
}

// Elements of another size (complex128, ...) byte-wise.
void move_tile_bytes(const unsigned char* src, unsigned char* dst, int64_t r0, int64_t r1, int64_t c0, int64_t c1, int64_t ld_src,
                     int64_t ld_dst, int64_t size) {
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t r = r0; r < r1; ++r) std::memcpy(dst + (c * ld_dst + r) * size, src + (r * ld_src + c) * size, size_t(size));
}

void move(const unsigned char* src, unsigned char* dst, int64_t r0, int64_t r1, int64_t c0, int64_t c1, int64_t ld_src,
          int64_t ld_dst, int64_t size) {
  switch (size) {
    case 1: return move_tile(src, dst, r0, r1, c0, c1, ld_src, ld_dst);
    case 2:
      return move_tile(reinterpret_cast<const uint16_t*>(src), reinterpret_cast<uint16_t*>(dst), r0, r1, c0, c1, ld_src, ld_dst);
    case 4:
      return move_tile(reinterpret_cast<const uint32_t*>(src), reinterpret_cast<uint32_t*>(dst), r0, r1, c0, c1, ld_src, ld_dst);
    case 8:
      return move_tile(reinterpret_cast<const uint64_t*>(src), reinterpret_cast<uint64_t*>(dst), r0, r1, c0, c1, ld_src, ld_dst);
    default: return move_tile_bytes(src, dst, r0, r1, c0, c1, ld_src, ld_dst, size);
  }
}

[[noreturn]] void refuse(const std::string& why) { throw std::invalid_argument("transpose_convert: " + why); }

}  // namespace

void transpose_convert(const unsigned char* src, unsigned char* dst, int64_t batch, int64_t rows, int64_t cols,
                       int64_t from, int64_t to, int64_t in, int64_t out, const ParallelFor& parallel_for) {
  if (batch < 0 || rows < 0 || cols < 0) refuse("negative size");
  const bool same = from == to;
  if (same ? (in <= 0 || in != out)
           : (from == kOther || to == kOther || in != (from == kFloat32 ? 4 : 2) || out != (to == kFloat32 ? 4 : 2)))
    refuse("unsupported element codes or sizes");
  if (batch == 0 || rows == 0 || cols == 0) return;
  const int64_t bands = (rows + kTile - 1) / kTile;  // a task: one band of kTile source rows of one matrix
  parallel_for(batch * bands, [&](int64_t begin, int64_t end) {
    thread_local std::vector<unsigned char> converted;  // one tile in the target type, for conversions
    if (!same && converted.size() < size_t(kTile * kTile * out)) converted.resize(size_t(kTile * kTile * out));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / bands, r0 = (task % bands) * kTile, r1 = std::min(rows, r0 + kTile);
      const unsigned char* s = src + b * rows * cols * in;
      unsigned char* d = dst + b * rows * cols * out;
      for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
        const int64_t c1 = std::min(cols, c0 + kTile);
        if (same) {
          move(s, d, r0, r1, c0, c1, cols, rows, in);
          continue;
        }
        const int64_t width = c1 - c0;
        for (int64_t r = r0; r < r1; ++r)  // the tile converted, row by row, at its place in `converted`
          convert_run(from, to, s + (r * cols + c0) * in, converted.data() + (r - r0) * width * out, width);
        // `converted` is rows [r0, r1) x columns [0, width) with `width` per row; its (r, c) lands at (c0 + c, r0 + r).
        move(converted.data(), d + (c0 * rows + r0) * out, 0, r1 - r0, 0, width, width, rows, out);
      }
    }
  });
}

}  // namespace fsdpfast
