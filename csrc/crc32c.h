// CRC-32C (Castagnoli), the manifest's per-tensor checksum.
//
// Chosen because x86 computes it in hardware (SSE4.2) and because CRCs combine: the CRC of
// A followed by B follows from crc(A), crc(B) and the length of B. So threads can checksum
// the output chunks they write, in any order, and the tensor's checksum is the chunks'
// combined in order: the same number the Python side gets by running over the whole tensor.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <nmmintrin.h>
#define FSDPFAST_CRC_X86 1
#endif

namespace fsdpfast {
namespace crc32c_detail {

constexpr uint32_t kPoly = 0x82F63B78u;  // the Castagnoli polynomial, bit-reversed

// Eight tables: the software path consumes 8 bytes per step.
struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
  }
};

inline const Tables& tables() {
  static const Tables built;
  return built;
}

inline uint32_t software(uint32_t crc, const unsigned char* p, size_t n) {
  const auto& t = tables().t;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    word ^= crc;  // little-endian: the register meets the first four bytes
    crc = t[7][word & 0xFF] ^ t[6][(word >> 8) & 0xFF] ^ t[5][(word >> 16) & 0xFF] ^ t[4][(word >> 24) & 0xFF] ^
          t[3][(word >> 32) & 0xFF] ^ t[2][(word >> 40) & 0xFF] ^ t[1][(word >> 48) & 0xFF] ^ t[0][word >> 56];
  }
  for (; n > 0; --n, ++p) crc = (crc >> 8) ^ t[0][(crc ^ *p) & 0xFF];
  return crc;
}

// a * b modulo the polynomial, both in the bit-reversed form (bit 31 is x^0).
inline uint32_t multiply(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t term = 1u << 31; term != 0; term >>= 1) {
    if (a & term) product ^= b;
    b = b & 1 ? (b >> 1) ^ kPoly : b >> 1;  // b *= x
  }
  return product;
}

// x^(8 * bytes) modulo the polynomial: what appending `bytes` bytes does to a CRC register.
inline uint32_t shift_of(uint64_t bytes) {
  uint32_t result = 1u << 31, power = 1u << 23;  // x^0 and x^8
  for (; bytes != 0; bytes >>= 1) {
    if (bytes & 1) result = multiply(result, power);
    power = multiply(power, power);
  }
  return result;
}

#ifdef FSDPFAST_CRC_X86
// One stream: the register in, the register out (no inversions).
__attribute__((target("sse4.2"))) inline uint64_t hardware_stream(uint64_t c, const unsigned char* p, size_t n) {
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  for (; n > 0; --n, ++p) c = _mm_crc32_u8(uint32_t(c), *p);
  return c;
}

// The crc32 instruction takes 3 cycles but can start one per cycle: three independent streams
// over thirds of the buffer keep it busy, and their registers are joined by polynomial shifts.
__attribute__((target("sse4.2"))) inline uint32_t hardware(uint32_t crc, const unsigned char* p, size_t n) {
  if (n < 3 * 4096) return uint32_t(hardware_stream(crc, p, n));
  const size_t third = (n / 3) & ~size_t(7);
  uint64_t a = crc, b = 0, c = 0;  // b and c: registers of raw streams that start from zero
  const unsigned char *pa = p, *pb = p + third, *pc = p + 2 * third;
  for (size_t i = 0; i < third; i += 8) {
    uint64_t wa, wb, wc;
    std::memcpy(&wa, pa + i, 8);
    std::memcpy(&wb, pb + i, 8);
    std::memcpy(&wc, pc + i, 8);
    a = _mm_crc32_u64(a, wa);
    b = _mm_crc32_u64(b, wb);
    c = _mm_crc32_u64(c, wc);
  }
  // Raw registers are linear: the register after A,B,C is A's shifted past B and C, xor B's
  // shifted past C, xor C's (the zero-start streams carry no initial value).
  thread_local size_t cached_third = 0;
  thread_local uint32_t cached_shift = 0;
  if (cached_third != third) cached_third = third, cached_shift = shift_of(third);
  uint32_t joined = multiply(multiply(uint32_t(a), cached_shift) ^ uint32_t(b), cached_shift) ^ uint32_t(c);
  return uint32_t(hardware_stream(joined, p + 3 * third, n - 3 * third));
}

inline bool has_sse42() {
  static const bool supported = __builtin_cpu_supports("sse4.2");
  return supported;
}
#endif

}  // namespace crc32c_detail

// CRC-32C of n bytes, continuing from `crc` (the CRC of what came before; 0 to start).
inline uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#ifdef FSDPFAST_CRC_X86
  if (crc32c_detail::has_sse42()) return ~crc32c_detail::hardware(crc, p, n);
#endif
  return ~crc32c_detail::software(crc, p, n);
}

// The CRC of A followed by B, from crc(A), crc(B) and B's length.
inline uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
  return crc32c_detail::multiply(crc_a, crc32c_detail::shift_of(length_b)) ^ crc_b;
}

}  // namespace fsdpfast
