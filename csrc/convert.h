// Bit-exact dtype conversions shared by the CPU and CUDA kernels.
//
// The reference is torch's own CPU Tensor.to() on contiguous data (its vectorised kernels):
// round to nearest even everywhere, subnormals kept, and for NaN:
//   float32 -> bfloat16: every NaN becomes 0xFFFF;
//   float16 -> bfloat16: every NaN becomes 0x7FC0;
//   float32 <-> float16 and bfloat16 -> float16: sign and top payload bits kept, quiet bit set
//   (the x86 F16C instructions torch uses);
//   bfloat16 -> float32: bits shifted, payload kept.
// (torch's scalar fallback, used for a few trailing elements, writes other NaN patterns.)
// Working on bits rather than on floats keeps the results identical on every compiler and device.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define FSDPFAST_HD __host__ __device__ __forceinline__
#else
#define FSDPFAST_HD inline
#endif

namespace fsdpfast {

// Element codes carried in a plan row; equal codes mean a plain byte copy.
enum Code : int64_t { kOther = 0, kFloat32 = 1, kBFloat16 = 2, kFloat16 = 3 };

FSDPFAST_HD uint32_t bf16_to_f32(uint16_t h) { return static_cast<uint32_t>(h) << 16; }

FSDPFAST_HD uint16_t f32_to_bf16(uint32_t x) {
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFFu;  // NaN
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

FSDPFAST_HD uint32_t f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0x1Fu) return sign | 0x7F800000u | (mant ? 0x400000u | (mant << 13) : 0u);  // Inf; NaN quieted
  if (exp != 0) return sign | ((exp + 112u) << 23) | (mant << 13);
  if (mant == 0) return sign;  // +-0
  // Subnormal: normalise the mantissa.
  uint32_t e = 113u;
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return sign | (e << 23) | ((mant & 0x3FFu) << 13);
}

FSDPFAST_HD uint16_t f32_to_f16(uint32_t x) {
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return sign | 0x7E00u | static_cast<uint16_t>((ax >> 13) & 0x3FFu);  // NaN, quieted
  if (ax >= 0x477FF000u) return sign | 0x7C00u;  // rounds past 65504: Inf
  if (ax < 0x38800000u) {                         // below the smallest normal: subnormal or zero
    uint32_t e = ax >> 23;
    if (e < 102u) return sign;  // under half the smallest subnormal
    uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126u - e;
    uint32_t result = mant >> shift;
    uint32_t rest = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (result & 1u))) ++result;
    return sign | static_cast<uint16_t>(result);
  }
  uint32_t rebased = ax - 0x38000000u;  // exponent bias 127 -> 15
  uint32_t result = rebased >> 13;
  uint32_t rest = rebased & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (result & 1u))) ++result;
  return sign | static_cast<uint16_t>(result);
}

// Convert one element between the float codes; both codes differ and are float codes.
FSDPFAST_HD uint32_t to_f32_bits(int64_t code, const unsigned char* p) {
  if (code == kFloat32) return *reinterpret_cast<const uint32_t*>(p);
  uint16_t h = *reinterpret_cast<const uint16_t*>(p);
  return code == kBFloat16 ? bf16_to_f32(h) : f16_to_f32(h);
}

FSDPFAST_HD void store_from_f32_bits(int64_t code, uint32_t bits, unsigned char* p) {
  if (code == kFloat32) {
    *reinterpret_cast<uint32_t*>(p) = bits;
  } else {
    *reinterpret_cast<uint16_t*>(p) = code == kBFloat16 ? f32_to_bf16(bits) : f32_to_f16(bits);
  }
}

// float16 -> bfloat16, given the float16 value widened to float32 bits: torch converts this
// pair without float32's NaN rule, writing every NaN as 0x7FC0.
FSDPFAST_HD uint16_t widened_f16_to_bf16(uint32_t bits) {
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0u) : f32_to_bf16(bits);
}

// One element from code `from` to code `to` (two different float codes).
FSDPFAST_HD void convert_element(int64_t from, int64_t to, const unsigned char* in, unsigned char* out) {
  const uint32_t bits = to_f32_bits(from, in);
  if (from == kFloat16 && to == kBFloat16) {
    *reinterpret_cast<uint16_t*>(out) = widened_f16_to_bf16(bits);
    return;
  }
  store_from_f32_bits(to, bits, out);
}

}  // namespace fsdpfast
