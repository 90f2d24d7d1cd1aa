// The kernels every other op builds on, registered for PrivateUse1: factories (memory from the HBM arena),
// views (metadata only, sharing the HBM storage), resize/set, and copies between CPU and ctpu. Everything
// else goes to the boxed fallback in torch_tpu_backend/device/fallback.py.
//
// HBM is host memory, so a copy is a CPU copy between host aliases of the two tensors: strides, dtype
// conversion, broadcasting and overlapping views all behave exactly as they do on the CPU.
#include "ctpu.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_local_scalar_dense.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <torch/library.h>

namespace ctpu {
namespace {

const c10::DispatchKeySet kKeySet(c10::DispatchKey::PrivateUse1);

void check_device(std::optional<c10::Device> device) {
  if (device.has_value() && device->has_index()) {
    check_device_index(device->index());
  }
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout>, std::optional<c10::Device> device,
                               std::optional<bool>, std::optional<c10::MemoryFormat> memory_format) {
  check_device(device);
  return at::detail::empty_generic(size, hbm_allocator(), kKeySet, c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout>, std::optional<c10::Device> device, std::optional<bool>) {
  check_device(device);
  return at::detail::empty_strided_generic(size, stride, hbm_allocator(), kKeySet, c10::dtype_or_default(dtype));
}

// A CPU tensor over the same host bytes as a ctpu tensor (CPU tensors are returned as they are).
at::Tensor host_alias(const at::Tensor& t) {
  if (t.device().type() != kDeviceType) {
    return t;
  }
  at::Tensor alias = at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(at::kCPU));
  alias._set_conj(t.is_conj());
  alias._set_neg(t.is_neg());
  return alias;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking: copies are synchronous*/) {
  for (const auto& t : {self, dst}) {
    TORCH_CHECK(t.is_cpu() || t.device().type() == kDeviceType, "ctpu: cannot copy between ", self.device(),
                " and ", dst.device());
  }
  if (self.numel() > 0 && dst.numel() > 0) {
    host_alias(dst).copy_(host_alias(self));
  }
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

c10::Scalar local_scalar_dense(const at::Tensor& self) {
  return at::_local_scalar_dense(host_alias(self));
}

// tensor.set_() with no source: an empty storage that still belongs to the ctpu allocator.
at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, hbm_allocator(), /*resizable=*/true);
  return self.set_(storage, 0, {0}, {});
}

// `tensor.data = other` between a ctpu and a CPU tensor (both dense host memory in one TensorImpl
// layout): PyTorch only accepts it when this says the two are compatible, and its default only pairs the
// built-in dense backends with themselves.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  if (self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set())) {
    return true;
  }
  const auto dense_host = [](const at::Tensor& t) {
    const auto type = t.device().type();
    return t.layout() == c10::kStrided && !t.is_quantized() && (type == c10::kCPU || type == kDeviceType);
  };
  return dense_host(self) && dense_host(from);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
  // Views: the generic (device independent) metadata kernels of ATen.
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("view_as_real", TORCH_FN(at::native::view_as_real));
  m.impl("view_as_complex", TORCH_FN(at::native::view_as_complex));
  // resize_/set_: the CPU implementations only touch metadata and grow storage through its own allocator
  // (ours), which is exactly right for an arena in host memory.
  m.impl("resize_", TORCH_FN(at::native::resize_));
  m.impl("set_.source_Storage", TORCH_FN(at::native::set_));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(at::native::set_storage_cpu_));
  m.impl("set_.source_Tensor", TORCH_FN(at::native::set_tensor_));
  m.impl("set_", TORCH_FN(set_empty));
}

// The conjugate/negative-bit fallbacks materialise their inputs with clone(), which copies through
// _copy_from, which would come back to them: let the bits through, the host copy resolves them.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

}  // namespace
}  // namespace ctpu
