// torch.autocast("ctpu"): the AutocastPrivateUse1 dispatch key gets torch's own cast policies (the op lists
// CUDA uses): matmuls and convolutions in the autocast dtype (bf16 by default), numerically sensitive ops
// (norms, softmax, exp, log, reductions, losses) in fp32, mixed-input ops promoted. Every other op falls
// through to the ctpu kernels unchanged. Without this key every op under autocast("ctpu") raised.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace {

using at::IntArrayRef;  // the op lists' signatures name these unqualified
using at::Scalar;
using at::ScalarType;
using at::Tensor;
using at::autocast::CastPolicy;

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define CTPU_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
  AT_FORALL_LOWER_PRECISION_FP(CTPU_LOWER_PRECISION_FP)
#define CTPU_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
  AT_FORALL_FP32(CTPU_FP32)
#define CTPU_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
  AT_FORALL_FP32_SET_OPT_DTYPE(CTPU_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
#define CTPU_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_PROMOTE(CTPU_PROMOTE)
}

}  // namespace
