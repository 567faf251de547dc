// The undo copies of speculated updates (host_adamw_rows.cc's state-argument form with
// undo, and its redo), kept by the library between a speculated call and its redo and
// found by the state buffer's address: the donated state both calls update in place.
// Not a result of the call: XLA:GPU gives a host call's result that another host call
// reads a buffer in device memory, so a state-sized undo would cross to the device and
// back (dos_jax.step.early_calls). A redo hands its copy back for the next speculated
// call of the same size to reuse: the pages stay mapped from step to step.
//
// Included by host_adamw_rows.cc; internal to it.

#ifndef DOS_JAX_KERNELS_UNDO_STORE_H_
#define DOS_JAX_KERNELS_UNDO_STORE_H_

#include <cstddef>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "adamw_common.h"

namespace dos_jax_host_adamw {

class UndoStore {
 public:
  // A buffer of `n` floats for the state at `key`, until `Release(key)`.
  float* Keep(const void* key, size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    auto live = live_.find(key);
    if (live != live_.end() && live->second.n == n) return live->second.data.get();
    Copy copy;
    auto spare = spare_.find(n);
    if (spare != spare_.end() && !spare->second.empty()) {
      copy = std::move(spare->second.back());
      spare->second.pop_back();
    } else {
      copy.n = n;
      copy.data.reset(new float[n]);  // not zeroed: only the elements copied in are read
      AdviseHugePages(copy.data.get(), n * sizeof(float));
    }
    float* data = copy.data.get();
    live_[key] = std::move(copy);
    return data;
  }

  // The buffer kept for the state at `key`, or nullptr when none of `n` floats is.
  const float* Find(const void* key, size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    auto live = live_.find(key);
    return live != live_.end() && live->second.n == n ? live->second.data.get() : nullptr;
  }

  // Hands the buffer kept for `key` back for reuse.
  void Release(const void* key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto live = live_.find(key);
    if (live == live_.end()) return;
    spare_[live->second.n].push_back(std::move(live->second));
    live_.erase(live);
  }

 private:
  struct Copy {
    size_t n = 0;
    std::unique_ptr<float[]> data;
  };
  std::mutex mu_;
  std::unordered_map<const void*, Copy> live_;
  std::unordered_map<size_t, std::vector<Copy>> spare_;
};

// The library's one store.
inline UndoStore& Undos() {
  static UndoStore* store = new UndoStore();  // never destroyed: calls may outlive exit
  return *store;
}

}  // namespace dos_jax_host_adamw

#endif  // DOS_JAX_KERNELS_UNDO_STORE_H_
