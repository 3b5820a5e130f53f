// Block-scaled float8 (e4m3fn) quantization: the rule, shared by the CPU and CUDA kernels.
//
// The reference is transformers' fine-grained FP8 quantizer (integrations/finegrained_fp8.py,
// Fp8Quantize), the format vLLM and SGLang load for DeepSeek-V3/Qwen3-FP8 style checkpoints.
// Per block of (up to) 128 x 128 elements of the last two dimensions, in float32:
//   amax      = max |x| over the block (NaN if any element is NaN)
//   scale     = amax > 0 ? (1 / amax) * 448 : 1       (torch's `448 / t` is reciprocal(t) * 448)
//   scale_inv = 1 / scale                             (stored, float32: dequantized = fp8 * scale_inv)
//   q         = fp8(clamp(x * scale, -448, 448))      (round to nearest even, as torch's .to())
// Partial blocks at the right and bottom edges use the same rule over the elements they hold
// (one scale each: ceil(rows / 128) x ceil(cols / 128) scales), as vLLM's loaders expect.
// Working on bits keeps the float8 rounding identical on every compiler and device.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FSDPFAST_FP8_HD __host__ __device__ __forceinline__
#else
#define FSDPFAST_FP8_HD inline
#endif

namespace fsdpfast {

constexpr float kFp8Max = 448.0f;  // largest finite float8_e4m3fn

FSDPFAST_FP8_HD uint32_t fp8_float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

FSDPFAST_FP8_HD float fp8_bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// float32 -> float8_e4m3fn byte, round to nearest even; what torch's cast does: magnitudes that
// round past 448 (and NaN) become NaN (0x7F with the sign), there is no infinity. The quantizer
// clamps to +-448 first, so only NaN input reaches NaN.
FSDPFAST_FP8_HD uint8_t f32_to_e4m3fn(float f) {
  const uint32_t bits = fp8_float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t ax = bits & 0x7FFFFFFFu;
  if (ax >= 0x43F00000u) return sign | 0x7Fu;  // >= 480 (rounds past 448), Inf, NaN
  if (ax < 0x3C800000u) {                       // below 2^-6, the smallest normal: subnormal steps of 2^-9
    // Adding 2^14 (whose float32 spacing is 2^-9) rounds |f| to a multiple of 2^-9, nearest even.
    const float shifted = fp8_bits_float(ax) + 16384.0f;
    return sign | static_cast<uint8_t>(fp8_float_bits(shifted) - 0x46800000u);
  }
  // Normal: rebias the exponent (127 -> 7) and drop 20 mantissa bits, ties to even.
  const uint32_t odd = (ax >> 20) & 1u;
  const uint32_t rounded = ax + 0x7FFFFu + odd - (120u << 23);
  return sign | static_cast<uint8_t>(rounded >> 20);
}

FSDPFAST_FP8_HD float fp8_block_amax_step(float running, float x) {
  const float a = x < 0.0f ? -x : x;  // NaN stays NaN (and then wins below)
  return (a > running || a != a) ? a : running;
}

FSDPFAST_FP8_HD float fp8_block_scale(float amax) { return amax > 0.0f ? (1.0f / amax) * kFp8Max : 1.0f; }

FSDPFAST_FP8_HD uint8_t fp8_block_quantize_one(float x, float scale) {
  float y = x * scale;
  y = y > kFp8Max ? kFp8Max : (y < -kFp8Max ? -kFp8Max : y);  // NaN passes, as torch.clamp
  return f32_to_e4m3fn(y);
}

}  // namespace fsdpfast
