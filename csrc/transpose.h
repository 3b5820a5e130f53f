// The transposed copy: a batch of matrices written with their rows and columns swapped.
//
// What a Hub layout that stores a packed tensor transposed needs (Qwen3-VL-MoE's experts: transformers
// holds [E, 2I, H], the Hub file [E, H, 2I]; gpt-oss's from Megatron): dst[b][c][r] = src[b][r][c].
// Torch-free, so the native CPU engine (bindings.cpp) and the torch ops (transpose_ops.cpp) share it.
#pragma once
#include <cstdint>

#include "kernels.h"

namespace fsdpfast {

// dst[b][c][r] = src[b][r][c] for b < batch, r < rows, c < cols, both contiguous. Elements are converted
// from code `from` (in bytes each) to code `to` (out bytes each) as gather_convert converts them;
// equal codes copy elements of `in` bytes (any size). Cache-blocked tiles, spread over `parallel_for`.
// Throws std::invalid_argument for sizes or codes it cannot take.
void transpose_convert(const unsigned char* src, unsigned char* dst, int64_t batch, int64_t rows, int64_t cols,
                       int64_t from, int64_t to, int64_t in, int64_t out, const ParallelFor& parallel_for);

}  // namespace fsdpfast
