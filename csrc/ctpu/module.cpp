// torch_tpu_backend.device._C: the Python handles of the extension. Loading it registers the allocator,
// guard, hooks and kernels (static registrations in the other files).
#include "ctpu.h"

#include <pybind11/pybind11.h>
#include <torch/csrc/Generator.h>

namespace py = pybind11;

namespace ctpu {
void install_python_allocator(py::object alloc_fn, py::object free_fn, py::object oom_type);
}  // namespace ctpu

PYBIND11_MODULE(_C, m) {
  m.doc() = "ctpu PrivateUse1 backend: HBM allocator, device guard, hooks, generator, core kernels";
  m.def("_install_allocator", &ctpu::install_python_allocator, py::arg("alloc_fn"), py::arg("free_fn"),
        py::arg("oom_type"),
        "alloc_fn(nbytes) -> HBM offset (sets the arena on first use), free_fn(offset), "
        "oom_type: the exception alloc_fn raises when HBM is full (becomes torch.OutOfMemoryError)");
  m.def(
      "_set_arena", [](std::uintptr_t base, std::size_t size) { ctpu::set_arena(base, size); }, py::arg("base"),
      py::arg("size"), "Hand over the HBM arena: the host address of CtpuDevice.hbm and its size in bytes");
  m.def(
      "_default_generator",
      [](c10::DeviceIndex index) {
        return py::reinterpret_steal<py::object>(THPGenerator_initDefaultGenerator(ctpu::default_generator(index)));
      },
      py::arg("index"));
  m.def("_current_device", [] { return static_cast<int>(ctpu::current_device()); });
  m.def("_set_device", [](int index) { ctpu::set_current_device(static_cast<c10::DeviceIndex>(index)); });
  m.def("_device_count", [] { return static_cast<int>(ctpu::kDeviceCount); });
}
