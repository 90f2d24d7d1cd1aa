// The profiler's device hooks: torch.profiler / torch.autograd.profiler.profile(use_device="ctpu") ask them
// for device timestamps around each op. Without them every op under such a profiler logged "PrivateUse1
// used in profiler but not enabled" and the kineto assertion after it. A launch runs to completion before it
// returns (the simulator is synchronous), so a device event is the host clock at the moment it is recorded.
#include "ctpu.h"

#include <c10/util/ApproximateClock.h>
#include <torch/csrc/profiler/stubs/base.h>

#include <chrono>
#include <memory>

namespace ctpu {
namespace {

using torch::profiler::impl::ProfilerVoidEventStub;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct CtpuProfilerStubs final : torch::profiler::impl::ProfilerStubs {
  void record(c10::DeviceIndex* device, ProfilerVoidEventStub* event, int64_t* cpu_ns) const override {
    if (device != nullptr) {
      *device = current_device();
    }
    *event = std::make_shared<int64_t>(now_ns());
    if (cpu_ns != nullptr) {
      *cpu_ns = c10::getTime();
    }
  }
  // Microseconds between two recorded events (what CUDA's stubs return).
  float elapsed(const ProfilerVoidEventStub* start, const ProfilerVoidEventStub* end) const override {
    const auto t0 = *static_cast<const int64_t*>(start->get());
    const auto t1 = *static_cast<const int64_t*>(end->get());
    return static_cast<float>(t1 - t0) / 1000.0F;
  }
  void mark(const char*) const override {}
  void rangePush(const char*) const override {}
  void rangePop() const override {}
  bool enabled() const override {
    return true;
  }
  void onEachDevice(std::function<void(int)> op) const override {
    for (c10::DeviceIndex i = 0; i < kDeviceCount; ++i) {
      op(i);
    }
  }
  void synchronize() const override {}  // launches are synchronous
};

const bool g_registered = [] {
  static CtpuProfilerStubs stubs;
  torch::profiler::impl::registerPrivateUse1Methods(&stubs);
  return true;
}();

}  // namespace
}  // namespace ctpu
