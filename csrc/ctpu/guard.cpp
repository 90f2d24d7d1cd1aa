// The device guard: which ctpu is current, and streams/events. A launch runs to completion before it
// returns (the simulator is synchronous), so there is one stream per device and every event is complete.
#include "ctpu.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

namespace ctpu {

namespace {
thread_local c10::DeviceIndex t_current_device = 0;  // per thread, like CUDA's current device
int g_event_done = 0;                               // the one (always complete) event
}  // namespace

void check_device_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < kDeviceCount, "ctpu: invalid device index ", static_cast<int>(index),
              " (there is ", static_cast<int>(kDeviceCount), " device)");
}

c10::DeviceIndex current_device() {
  return t_current_device;
}

void set_current_device(c10::DeviceIndex index) {
  check_device_index(index);
  t_current_device = index;
}

namespace {

struct CtpuGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kDeviceType;
  }
  c10::Device exchangeDevice(c10::Device device) const override {
    const c10::Device old = getDevice();
    setDevice(device);
    return old;
  }
  c10::Device getDevice() const override {
    return {kDeviceType, current_device()};
  }
  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.type() == kDeviceType, "ctpu guard got a ", device.type(), " device");
    set_current_device(device.has_index() ? device.index() : 0);
  }
  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.index() >= 0 && device.index() < kDeviceCount) {
      t_current_device = device.index();
    }
  }
  c10::Stream getStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::DEFAULT, device);
  }
  c10::Stream getDefaultStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::DEFAULT, device);
  }
  c10::Stream exchangeStream(c10::Stream stream) const override {
    return c10::Stream(c10::Stream::DEFAULT, stream.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return kDeviceCount;
  }
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    *event = &g_event_done;
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override {
    return true;
  }
  bool queryStream(const c10::Stream&) const override {
    return true;
  }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  // torch.accelerator.get_device_capability: every dtype a tensor can be allocated in and converted
  // between (HBM holds any bytes; ops the CTPU cannot run fall back to the CPU). Quantized tensors are
  // not supported (no QuantizedPrivateUse1 kernels), so their bits are cleared.
  c10::DeviceCapability getDeviceCapability(c10::Device) const override {
    c10::DeviceCapability cap;
    for (const auto index : {c10::kIndex_QInt8, c10::kIndex_QUInt8, c10::kIndex_QInt32, c10::kIndex_QUInt4x2,
                             c10::kIndex_QUInt2x4}) {
      cap.capability_data.capability_bits &= ~(1ULL << index);
    }
    return cap;
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, CtpuGuardImpl);

}  // namespace
}  // namespace ctpu
