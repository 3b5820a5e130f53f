// torch.ops.fsdpfast.lora_merge / lora_merge_bias: one weight with a LoRA adapter fused in.
//
// The result must equal peft's merge_and_unload() bit for bit, so these ops make exactly the
// ATen calls peft's LoRA layers make, in the same order and dtypes (peft 0.21, unsafe merge):
//   Linear:    delta = (B @ A) [transposed if fan_in_fan_out] * scaling, computed in lora_B's
//              dtype (widened to float32 first on the CPU when that is float16/bfloat16, the
//              delta rounded back), then weight += delta in place (mixed dtypes: TensorIterator
//              computes in the promoted type and rounds into the weight's).
//   Embedding: delta = (B @ A).T * scaling in lora_embedding_A's dtype (same CPU widening), cast
//              to the weight's dtype, then weight += delta.
//   lora_bias: bias += lora_B.bias * scaling.
// The schemas are in ops.cpp. Only ATen ops are called, so one registration (CompositeExplicitAutograd) serves the CPU and
// CUDA; on a GPU the matmul runs there, as peft's would for a model on that GPU.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace fsdpfast {
namespace {

bool widened_on_cpu(const at::Tensor& t, at::ScalarType dtype) {
  return t.device().is_cpu() && (dtype == at::kHalf || dtype == at::kBFloat16);
}

at::Tensor lora_merge(const at::Tensor& weight, const at::Tensor& lora_A, const at::Tensor& lora_B, double scaling,
                      bool fan_in_fan_out, bool embedding) {
  TORCH_CHECK(weight.dim() == 2 && lora_A.dim() == 2 && lora_B.dim() == 2,
              "lora_merge takes 2-D weight, lora_A and lora_B");
  TORCH_CHECK(weight.device() == lora_A.device() && weight.device() == lora_B.device(),
              "lora_merge: weight, lora_A and lora_B must be on one device");
  TORCH_CHECK(lora_B.size(1) == lora_A.size(0), "lora_merge: lora_B ", lora_B.sizes(), " and lora_A ", lora_A.sizes(),
              " do not share a rank");
  const bool transposed = embedding || fan_in_fan_out;
  const int64_t rows = transposed ? lora_A.size(1) : lora_B.size(0);
  const int64_t cols = transposed ? lora_B.size(0) : lora_A.size(1);
  TORCH_CHECK(weight.size(0) == rows && weight.size(1) == cols, "lora_merge: weight ", weight.sizes(),
              " does not match lora_B @ lora_A", transposed ? " transposed" : "", " (", rows, ", ", cols, ")");
  const at::ScalarType dtype = embedding ? lora_A.scalar_type() : lora_B.scalar_type();
  const bool widen = widened_on_cpu(weight, dtype);
  const at::Tensor a = widen ? lora_A.to(at::kFloat) : lora_A;
  const at::Tensor b = widen ? lora_B.to(at::kFloat) : lora_B;
  at::Tensor product = at::matmul(b, a);
  if (transposed) product = product.t();
  at::Tensor delta = product.mul(scaling);
  if (widen) delta = delta.to(dtype);
  if (embedding) delta = delta.to(weight.scalar_type());
  at::Tensor merged = weight.clone(at::MemoryFormat::Contiguous);
  merged.add_(delta);
  return merged;
}

at::Tensor lora_merge_bias(const at::Tensor& bias, const at::Tensor& lora_bias, double scaling) {
  TORCH_CHECK(bias.sizes() == lora_bias.sizes(), "lora_merge_bias: bias ", bias.sizes(), " and lora_B bias ",
              lora_bias.sizes(), " differ in shape");
  at::Tensor merged = bias.clone(at::MemoryFormat::Contiguous);
  merged.add_(lora_bias.mul(scaling));
  return merged;
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdpfast, CompositeExplicitAutograd, m) {
  m.impl("lora_merge", &lora_merge);
  m.impl("lora_merge_bias", &lora_merge_bias);
}

}  // namespace fsdpfast
