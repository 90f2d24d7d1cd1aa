// PrivateUse1 hooks (what torch.accelerator, pin_memory, storage resize and generators ask the backend)
// and the device's random generator.
#include "ctpu.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

namespace ctpu {
namespace {

// The CPU's mt19937 generator, labelled as a ctpu device generator (as torch_openreg does):
// random ops fall back to CPU kernels, which run with this generator's state, so randn on ctpu equals randn
// on CPU under the same seed and manual_seed / get_rng_state / set_rng_state behave like the CPU's.
struct CtpuGeneratorImpl final : at::CPUGeneratorImpl {
  explicit CtpuGeneratorImpl(c10::DeviceIndex index) {
    device_ = c10::Device(kDeviceType, index);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }

 private:
  CtpuGeneratorImpl* clone_impl() const override {
    auto* gen = new CtpuGeneratorImpl(device_.index());
    gen->set_state(*get_state());
    return gen;
  }
};

// Host memory for pin_memory(): ordinary host memory (HBM is host memory, so a copy from it is as fast as
// from any other), but recorded, so is_pinned() answers True for it and for any pointer inside it (a
// storage slice), as CUDA's pinned allocator does, and False for other host memory.
class PinnedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nbytes == 0 ? nullptr : std::malloc(nbytes);
    TORCH_CHECK(nbytes == 0 || ptr != nullptr, "ctpu: pinned host allocation of ", nbytes, " bytes failed");
    if (ptr != nullptr) {
      std::lock_guard<std::mutex> lock(mutex());
      blocks()[reinterpret_cast<std::uintptr_t>(ptr)] = nbytes;
    }
    return {ptr, ptr, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &release;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  static bool contains(const void* ptr) {
    const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mutex());
    auto it = blocks().upper_bound(addr);  // the first block starting after addr
    if (it == blocks().begin()) {
      return false;
    }
    --it;
    return addr < it->first + it->second;
  }

 private:
  static void release(void* ptr) {
    {
      std::lock_guard<std::mutex> lock(mutex());
      blocks().erase(reinterpret_cast<std::uintptr_t>(ptr));
    }
    std::free(ptr);
  }
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<std::uintptr_t, std::size_t>& blocks() {  // start -> size of each live block
    static std::map<std::uintptr_t, std::size_t> b;
    return b;
  }
};

PinnedAllocator g_pinned_allocator;

struct CtpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(c10::DeviceIndex index) const override {
    check_device_index(index);
    return true;
  }
  c10::DeviceIndex deviceCount() const override {
    return kDeviceCount;
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return current_device();
  }
  void setCurrentDevice(c10::DeviceIndex index) const override {
    set_current_device(index);
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex index) const override {
    const auto old = current_device();
    set_current_device(index);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex index) const override {
    return exchangeDevice(index);
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    return default_generator(index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return at::make_generator<CtpuGeneratorImpl>(index < 0 ? current_device() : index);
  }
  c10::Device getDeviceFromPtr(void* data) const override {
    TORCH_CHECK(in_arena(data), "ctpu: pointer ", data, " is not in the HBM arena");
    return {kDeviceType, 0};
  }
  bool isPinnedPtr(const void* data) const override {
    return PinnedAllocator::contains(data);
  }
  c10::Allocator* getPinnedMemoryAllocator() const override {
    return &g_pinned_allocator;
  }
  // UntypedStorage.resize_() on a ctpu storage: new HBM block, old bytes copied, rest uninitialised.
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t new_bytes) const override {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "ctpu: trying to resize a storage that is not resizable");
    c10::DataPtr data = impl->allocator()->allocate(new_bytes);
    const size_t keep = std::min(new_bytes, impl->nbytes());
    if (keep > 0) {
      std::memcpy(data.get(), impl->data(), keep);
    }
    impl->set_data_ptr_noswap(std::move(data));
    impl->set_nbytes(new_bytes);
  }
};

// Registered when the extension loads; PyTorch keeps the pointer for the life of the process.
const bool g_hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new CtpuHooks());
  return true;
}();

}  // namespace

const at::Generator& default_generator(c10::DeviceIndex index) {
  static std::once_flag once;
  static std::vector<at::Generator> generators;
  std::call_once(once, [] {
    for (c10::DeviceIndex i = 0; i < kDeviceCount; ++i) {
      generators.push_back(at::make_generator<CtpuGeneratorImpl>(i));
    }
  });
  const auto i = index < 0 ? current_device() : index;
  check_device_index(i);
  return generators[i];
}

}  // namespace ctpu
