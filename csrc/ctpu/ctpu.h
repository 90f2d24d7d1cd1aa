// The ctpu PrivateUse1 backend: what Python cannot do (allocator, device guard, hooks, generator, the
// storage/view/copy kernels every other op needs). Each piece lives in its own small file, as in torch_openreg.
#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>

namespace ctpu {

constexpr c10::DeviceType kDeviceType = c10::DeviceType::PrivateUse1;
// One simulated CTPU per process (runtime.get_device()); more would be more arenas, not more code.
constexpr c10::DeviceIndex kDeviceCount = 1;

// device.cpp: the current device index of this thread (always 0 today, checked like CUDA's).
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex index);
void check_device_index(c10::DeviceIndex index);

// allocator.cpp: device memory is the runtime's HBM arena (a numpy byte array in host memory).
c10::Allocator* hbm_allocator();
void set_arena(std::uintptr_t base, std::size_t size);
bool in_arena(const void* ptr);

// hooks.cpp: the device's default random generator.
const at::Generator& default_generator(c10::DeviceIndex index);

}  // namespace ctpu
