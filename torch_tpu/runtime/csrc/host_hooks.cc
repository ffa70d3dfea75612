// The tpu device's PrivateUse1 hooks in C++ (torch_tpu/runtime/host_hooks.py builds and registers
// this in place of torch's Python hook class): beyond availability, a pinned host memory allocator,
// which torch asks the accelerator for (`pin_memory=True`, `Tensor.pin_memory()`, DDP's static-graph
// used-parameter map) and which a Python hook cannot provide.
//
// Pinned memory here is page-aligned host memory from torch's CPU allocator, recorded so that
// `is_pinned()` answers for it: the device's runtime (PJRT) copies from any host memory.

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <mutex>
#include <unordered_set>

namespace {

std::mutex live_mutex;
std::unordered_set<const void*>& live() {
  static auto* pointers = new std::unordered_set<const void*>();
  return *pointers;
}

void free_pinned(void* data) {
  {
    std::lock_guard<std::mutex> lock(live_mutex);
    live().erase(data);
  }
  c10::free_cpu(data);
}

struct PinnedHostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    void* data = bytes ? c10::alloc_cpu(bytes) : nullptr;
    if (data != nullptr) {
      std::lock_guard<std::mutex> lock(live_mutex);
      live().insert(data);
    }
    return {data, data, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

struct TpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  at::Allocator* getPinnedMemoryAllocator() const override {
    static PinnedHostAllocator allocator;
    return &allocator;
  }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(live_mutex);
    return live().count(data) > 0;
  }
};

}  // namespace

extern "C" __attribute__((visibility("default"))) void torch_tpu_register_hooks() {
  static TpuHooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
}
