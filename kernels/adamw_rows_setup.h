// What every form of the in-memory row call (host_adamw_rows.cc) shares: the checks of
// the state, slots, rows and dtypes, the loop picked for them, and the split of the
// listed rows' elements over the threads.
//
// Included by host_adamw_rows.cc; internal to it.

#ifndef DOS_JAX_KERNELS_ADAMW_ROWS_SETUP_H_
#define DOS_JAX_KERNELS_ADAMW_ROWS_SETUP_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "adamw_loop.h"
#include "adamw_rows.h"
#include "xla/ffi/api/ffi.h"

namespace dos_jax_host_adamw {

inline ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("dos_jax_adamw_host_rows: " + what);
}

// What every form of the call shares: the state, the rows, the step's constants, the
// loop, and the out buffer.
struct Setup {
  int64_t G, K, S, R;
  int64_t master_k, mu_k, nu_k, decayed_rows, threads;
  bool has_master;
  const int32_t* rows;
  float* state;
  RowFn fn;
  char* out;
  size_t out_bytes;
};

// Checks the state, slots, rows and dtypes, picks the loop, and makes the state output
// `state_out` hold the input state (a copy when XLA did not alias them; nothing when
// it is the input's own buffer).
inline ffi::Error Prepare(ffi::Buffer<ffi::F32>& stacked, ffi::Buffer<ffi::S32>& rows,
                          ffi::Buffer<ffi::F32>& coeffs, ffi::DataType grad_type,
                   float* state_out, ffi::DataType out_type, int64_t master_k, int64_t mu_k,
                   int64_t nu_k, int64_t decayed_rows, int64_t num_threads,
                   bool nesterov, int64_t isa, Setup& su) {
  const auto dims = stacked.dimensions();
  if (dims.size() != 3) return Invalid("stacked must be (G, K, S)");
  su.G = dims[0], su.K = dims[1], su.S = dims[2];
  su.R = static_cast<int64_t>(rows.element_count());
  su.has_master = master_k >= 0;
  for (int64_t k : {mu_k, nu_k, su.has_master ? master_k : mu_k}) {
    if (k < 0 || k >= su.K) return Invalid("slot index out of range");
  }
  if (mu_k == nu_k || (su.has_master && (master_k == mu_k || master_k == nu_k))) {
    return Invalid("slots must be distinct");
  }
  if (coeffs.element_count() != kNumSlots) return Invalid("bad coefficient vector");
  su.rows = rows.typed_data();
  std::vector<bool> seen(su.G, false);
  for (int64_t j = 0; j < su.R; ++j) {
    const int32_t g = su.rows[j];
    if (g < 0 || g >= su.G || seen[g]) return Invalid("rows must be distinct, in [0, G)");
    seen[g] = true;
  }
  if (!ResolveIsa(isa)) {
    return Invalid("this CPU lacks the ISA asked for");
  }
  su.fn = SelectRows(grad_type, su.has_master, out_type, nesterov, isa);
  if (su.fn == nullptr) return Invalid("unsupported dtypes");
  su.master_k = master_k, su.mu_k = mu_k, su.nu_k = nu_k, su.decayed_rows = decayed_rows;
  su.threads = num_threads;
  su.out = nullptr;  // the caller's
  su.out_bytes = ffi::ByteWidth(out_type);
  su.state = state_out;
  const float* state_in = stacked.typed_data();
  const int64_t state_size = su.G * su.K * su.S;
  if (su.state != state_in) {  // XLA did not alias the state (not donated): copy it first
    ParallelFor(state_size, ThreadsFor(state_size, num_threads),
                [&](int64_t b, int64_t e) {
                  std::memcpy(su.state + b, state_in + b, (e - b) * sizeof(float));
                });
  }
  return ffi::Error::Success();
}

// Runs segment(j, g, begin, end) over all R * S elements of the listed rows: row j of
// the call is subgroup g; [begin, end) are offsets within the subgroup.
template <class Segment>
void ForEachSegment(const Setup& su, const Segment& segment) {
  const int64_t total = su.R * su.S;
  ParallelFor(total, ThreadsFor(total, su.threads), [&](int64_t begin, int64_t end) {
    ScopedFlushDenormals flush;
    while (begin < end) {
      const int64_t j = begin / su.S;
      const int64_t offset = begin - j * su.S;
      const int64_t stop = std::min(end - j * su.S, su.S);
      segment(j, static_cast<int64_t>(su.rows[j]), offset, stop);
      begin = j * su.S + stop;
    }
  });
}

// The state rows of subgroup g from element `at` on.
inline RowPointers StateAt(const Setup& su, int64_t g, int64_t at) {
  float* sub = su.state + g * su.K * su.S;
  return RowPointers{su.has_master ? sub + su.master_k * su.S + at : nullptr,
                     sub + su.mu_k * su.S + at, sub + su.nu_k * su.S + at,
                     nullptr, nullptr, nullptr};
}

}  // namespace dos_jax_host_adamw

#endif  // DOS_JAX_KERNELS_ADAMW_ROWS_SETUP_H_
