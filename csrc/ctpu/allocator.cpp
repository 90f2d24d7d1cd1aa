// Device memory IS the simulated HBM: every ctpu tensor's data_ptr points into CtpuDevice.hbm (a numpy
// byte array in host memory), so a kernel launch reads and writes tensors in place.
//
// What is allocated is decided in one place only, the runtime's HbmAllocator (Python), which a compiled
// graph's workspace also allocates from. This allocator therefore calls back into Python (under the GIL)
// for every allocation and free; it adds the arena base to the HBM offset it gets back.
//
// Both calls may come while a Python exception is already set on this thread: when an op raises, the
// interpreter releases the call's arguments with the error set, so a temporary ctpu argument
// (`torch.matmul(torch.randn(5, 5, device="ctpu"), torch.randn(3, 3, device="ctpu"))`) is freed right then.
// Python code must never run with an error set: a builtin that succeeds then raises SystemError after
// the fact (RLock.__enter__ takes the lock and raises, so the `with` never releases it: the allocator's
// lock leaked and the next allocation on another thread, e.g. backward's autograd worker, waited
// forever), and the op's own error is lost ("error return without exception set").
// `py::error_scope` sets the pending error aside for the call and restores it after.
#include "ctpu.h"

#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstring>
#include <string>

namespace py = pybind11;

namespace ctpu {
namespace {

std::atomic<std::uintptr_t> g_base{0};
std::atomic<std::size_t> g_size{0};
// Leaked on purpose: Python objects must not be destroyed by C++ static destructors after Py_Finalize.
py::object* g_alloc_fn = nullptr;  // (nbytes: int) -> HBM offset: int; sets the arena on first use
py::object* g_free_fn = nullptr;   // (offset: int) -> None
py::object* g_oom_type = nullptr;  // the exception class g_alloc_fn raises when HBM is full

bool python_is_gone() {
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsInitialized() || Py_IsFinalizing();
#else
  return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

void hbm_free(void* ptr) {
  // At interpreter exit the arena dies with the process: nothing to give back, and no GIL to take.
  if (ptr == nullptr || g_free_fn == nullptr || python_is_gone()) {
    return;
  }
  const auto offset = reinterpret_cast<std::uintptr_t>(ptr) - g_base.load();
  py::gil_scoped_acquire gil;
  py::error_scope pending;  // see the top of this file
  try {
    (*g_free_fn)(offset);
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable("ctpu HBM free");  // a deleter must not throw
  }
}

struct HbmArenaAllocator final : c10::Allocator {
  c10::DataPtr allocate(std::size_t nbytes) override {
    const c10::Device device(kDeviceType, current_device());
    if (nbytes == 0) {
      return {nullptr, nullptr, &hbm_free, device};
    }
    TORCH_CHECK(g_alloc_fn != nullptr, "ctpu: the device is not initialised (import torch_tpu_backend.device)");
    std::int64_t offset = -1;
    std::string error;
    bool oom = false;
    {
      py::gil_scoped_acquire gil;
      py::error_scope pending;  // see the top of this file
      try {
        offset = (*g_alloc_fn)(nbytes).cast<std::int64_t>();
      } catch (py::error_already_set& e) {
        oom = e.matches(*g_oom_type);
        error = py::str(e.value()).cast<std::string>();
      }
    }
    TORCH_CHECK_WITH(OutOfMemoryError, !oom, error);
    TORCH_CHECK(error.empty(), "ctpu: HBM allocation of ", nbytes, " bytes failed: ", error);
    TORCH_CHECK(offset > 0 && offset + nbytes <= g_size.load(), "ctpu: HBM allocator returned offset ", offset,
                " for ", nbytes, " bytes, outside the arena of ", g_size.load(), " bytes");
    void* ptr = reinterpret_cast<void*>(g_base.load() + static_cast<std::uintptr_t>(offset));
    return {ptr, ptr, &hbm_free, device};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &hbm_free;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);  // HBM is host memory
  }
};

HbmArenaAllocator g_allocator;

}  // namespace

c10::Allocator* hbm_allocator() {
  return &g_allocator;
}

void set_arena(std::uintptr_t base, std::size_t size) {
  const auto old = g_base.load();
  TORCH_CHECK(old == 0 || old == base, "ctpu: the HBM arena cannot move once tensors live in it");
  g_base = base;
  g_size = size;
}

bool in_arena(const void* ptr) {
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  return p >= g_base.load() && p < g_base.load() + g_size.load();
}

void install_python_allocator(py::object alloc_fn, py::object free_fn, py::object oom_type) {
  g_alloc_fn = new py::object(std::move(alloc_fn));
  g_free_fn = new py::object(std::move(free_fn));
  g_oom_type = new py::object(std::move(oom_type));
}

// torch.UntypedStorage(n, device="ctpu") and friends find the allocator by device type.
REGISTER_ALLOCATOR(kDeviceType, &g_allocator);

}  // namespace ctpu
