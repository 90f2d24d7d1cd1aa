// Backend tensor metadata (torch._utils.set_tensor_metadata / get_tensor_metadata): a ctpu tensor may carry
// a map of named flags that torch.save writes beside it, torch.load restores, _copy_backend_meta copies and
// FakeTensor conversion keeps. The device gives the flags no meaning; without this registration PyTorch
// dropped them silently (set_tensor_metadata was a no-op and get_tensor_metadata returned {}).
#include "ctpu.h"

#include <c10/core/TensorImpl.h>
#include <torch/csrc/jit/serialization/pickler_helper.h>

#include <string>
#include <unordered_map>
#include <utility>

namespace ctpu {
namespace {

using Flags = std::unordered_map<std::string, bool>;

struct CtpuBackendMeta final : c10::BackendMeta {
  explicit CtpuBackendMeta(Flags f) : flags(std::move(f)) {}
  // A copy, so a tensor that receives it (_copy_backend_meta, a shallow copy) does not share later changes.
  c10::intrusive_ptr<c10::BackendMeta> clone(const c10::intrusive_ptr<c10::BackendMeta>&) const override {
    return c10::make_intrusive<CtpuBackendMeta>(flags);
  }
  Flags flags;
};

// Called by get_tensor_metadata and torch.save: add this tensor's flags to `out`.
void get_flags(const at::Tensor& tensor, Flags& out) {
  const auto* meta = dynamic_cast<const CtpuBackendMeta*>(tensor.unsafeGetTensorImpl()->get_backend_meta());
  if (meta != nullptr) {
    out.insert(meta->flags.begin(), meta->flags.end());
  }
}

// Called by set_tensor_metadata and torch.load with the whole metadata map (torch's own entries, e.g.
// conj_bit, are consumed before): the remaining entries become the tensor's flags.
void set_flags(const at::Tensor& tensor, Flags& in) {
  if (in.empty()) {
    return;
  }
  tensor.unsafeGetTensorImpl()->set_backend_meta(c10::make_intrusive<CtpuBackendMeta>(in));
}

const bool g_registered = [] {
  torch::jit::TensorBackendMetaRegistry(kDeviceType, &get_flags, &set_flags);
  return true;
}();

}  // namespace
}  // namespace ctpu
