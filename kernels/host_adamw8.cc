// Native AdamW with block-wise 8-bit moments (kernels/adamw8_reference.py's format): an
// XLA FFI custom call for the CPU platform over rows of an fp32 master, uint8 codes and
// fp32 per-block scales of mu and nu, all updated in place.
//
// The loop is adamw8_loop.h's (scalar, per instruction set) and adamw8_avx512.h's.
// Per block of kBlock8 elements of a row, in three passes over L1: (1) decode mu and nu
// (map[code] * scale), the new moments, their block maxima; (2) the direction, the new
// master and its 16-bit cast; (3) the new codes, the nearest map entry of m / max. The
// decoded and the new moments live only in a per-thread scratch of one block (256
// floats each, in L1); no state-sized fp32 copy of a moment exists.
//
// Arithmetic: every operation rounded to fp32 in adamw8_reference.adamw8_step's order
// (dtype=np.float32), no FMA (-ffp-contract=off), denormals flushed as XLA:CPU does. The
// masters and the scales are then the reference's bit for bit; a code may differ by one
// from the reference's (float64) nearest code where m / max lies within a few fp32 steps
// of a midpoint between two entries, since the kernel multiplies by the fp32 reciprocal
// of the max.
//
// Nearest code without a search: the Python side builds, per map and sign, a table over
// buckets of |x| (its fp32 exponent and top 8 mantissa bits, 2^-24 <= |x| <= 1: 6145
// buckets) whose entry holds the code of the bucket's lower edge and the one midpoint
// between codes the bucket can contain (the map's entries are at least 0.7% apart, a
// bucket at most 0.39% wide), as fp32 bits within the bucket; one gather and one integer
// compare give the code (host_adamw8.py, `_encoding_table`).

#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "adamw8_avx512.h"
#include "adamw8_loop.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace dos_jax_host_adamw8;  // NOLINT: the loop's internals

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("dos_jax_adamw8_host: " + what);
}

inline bool HasVbmi() {
#if DOS_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}

// The AVX-512 blocks for G, L.
template <class G, class L>
Block8Fn Avx512For(bool nesterov) {
#if DOS_X86
  return nesterov ? &Blocks8Avx512<G, L, true> : &Blocks8Avx512<G, L, false>;
#else
  return nullptr;
#endif
}

template <class G>
Block8Fn SelectOut8(ffi::DataType out, bool nesterov, int64_t isa) {
  if (isa == kAvx512 && HasVbmi()) {
    switch (out) {
      case ffi::DataType::INVALID: return Avx512For<G, NoLowp>(nesterov);
      case ffi::DataType::F32: return Avx512For<G, F32>(nesterov);
      case ffi::DataType::BF16: return Avx512For<G, BF16>(nesterov);
      case ffi::DataType::F16: return Avx512For<G, F16>(nesterov);
      default: return nullptr;
    }
  }
  switch (out) {
    case ffi::DataType::INVALID: return SelectIsa<Blocks8<G, NoLowp>>(nesterov, isa);
    case ffi::DataType::F32: return SelectIsa<Blocks8<G, F32>>(nesterov, isa);
    case ffi::DataType::BF16: return SelectIsa<Blocks8<G, BF16>>(nesterov, isa);
    case ffi::DataType::F16: return SelectIsa<Blocks8<G, F16>>(nesterov, isa);
    default: return nullptr;
  }
}

Block8Fn Select8(ffi::DataType grad, ffi::DataType out, bool nesterov, int64_t isa) {
  switch (grad) {
    case ffi::DataType::F32: return SelectOut8<F32>(out, nesterov, isa);
    case ffi::DataType::BF16: return SelectOut8<BF16>(out, nesterov, isa);
    default: return nullptr;
  }
}

// Runs fn(begin, end) over blocks [0, total) in chunks from a shared counter.
template <class Fn>
void ParallelBlocks(int64_t total, int64_t threads, const Fn& fn) {
  const int64_t chunk = std::max<int64_t>(64, total / (threads * kChunksPerThread));
  std::atomic<int64_t> next{0};
  auto work = [&] {
    ScopedFlushDenormals flush;
    for (int64_t begin; (begin = next.fetch_add(chunk)) < total;) {
      fn(begin, std::min(total, begin + chunk));
    }
  };
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t) {
    try {
      workers.emplace_back(work);
    } catch (const std::system_error&) {
      break;
    }
  }
  work();
  for (auto& w : workers) w.join();
}

// Rows (R, S) of master, codes and grads; scales (R, ceil(S / kBlock8)); rows below
// `decayed_rows` get weight decay. Everything but grads, coefficients and tables is
// updated in place (aliased inputs and results).
ffi::Error Adamw8Impl(ffi::Buffer<ffi::F32> master, ffi::Buffer<ffi::U8> mu_codes,
                      ffi::Buffer<ffi::F32> mu_scales, ffi::Buffer<ffi::U8> nu_codes,
                      ffi::Buffer<ffi::F32> nu_scales, ffi::AnyBuffer grad,
                      ffi::Buffer<ffi::F32> coeffs, ffi::Buffer<ffi::F32> maps,
                      ffi::Buffer<ffi::U32> tables,
                      ffi::ResultBuffer<ffi::F32> master_out,
                      ffi::ResultBuffer<ffi::U8> mu_codes_out,
                      ffi::ResultBuffer<ffi::F32> mu_scales_out,
                      ffi::ResultBuffer<ffi::U8> nu_codes_out,
                      ffi::ResultBuffer<ffi::F32> nu_scales_out,
                      ffi::Result<ffi::AnyBuffer> out, int64_t decayed_rows,
                      int64_t num_threads, bool nesterov, int64_t isa) {
  const auto dims = master.dimensions();
  if (dims.size() != 2) return Invalid("master must be (R, S)");
  const int64_t R = dims[0], S = dims[1], NB = (S + kBlock8 - 1) / kBlock8;
  const auto n = static_cast<size_t>(R * S);
  if (mu_codes.element_count() != n || nu_codes.element_count() != n ||
      grad.element_count() != n) {
    return Invalid("codes and grads must be (R, S) like master");
  }
  if (mu_scales.element_count() != static_cast<size_t>(R * NB) ||
      nu_scales.element_count() != static_cast<size_t>(R * NB)) {
    return Invalid("scales must be (R, ceil(S / 256))");
  }
  const bool has_out = out->element_count() != 0;
  if (has_out && out->element_count() != n) return Invalid("out must be (R, S) or empty");
  if (coeffs.element_count() != kNumSlots) return Invalid("bad coefficient vector");
  if (maps.element_count() != 2 * 256 || tables.element_count() != 4 * kBucketStride) {
    return Invalid("bad quantization tables");
  }
  if (master_out->typed_data() != master.typed_data() ||
      mu_codes_out->typed_data() != mu_codes.typed_data() ||
      mu_scales_out->typed_data() != mu_scales.typed_data() ||
      nu_codes_out->typed_data() != nu_codes.typed_data() ||
      nu_scales_out->typed_data() != nu_scales.typed_data()) {
    return Invalid("the state must be aliased to the results");
  }
  if (!ResolveIsa(isa)) return Invalid("this CPU lacks the ISA asked for");
  Block8Fn fn = Select8(grad.element_type(), has_out ? out->element_type()
                                                     : ffi::DataType::INVALID, nesterov, isa);
  if (fn == nullptr) return Invalid("unsupported dtypes");
  if (has_out) AdviseHugePages(out->untyped_data(), out->size_bytes());
  const Coeffs c(coeffs.typed_data());
  Tables t;
  uint8_t planes[2][4][256];
  for (int k = 0; k < 2; ++k) {
    t.map[k] = maps.typed_data() + k * 256;
    t.enc[k] = tables.typed_data() + k * 2 * kBucketStride;
    for (int p = 0; p < 4; ++p) {
      for (int e = 0; e < 256; ++e) {
        planes[k][p][e] = static_cast<uint8_t>(FloatToBits(t.map[k][e]) >> (8 * p));
      }
    }
    t.planes[k] = &planes[k][0][0];
  }
  const size_t grad_bytes = ffi::ByteWidth(grad.element_type());
  const size_t out_bytes = has_out ? ffi::ByteWidth(out->element_type()) : 0;
  auto* grad_base = static_cast<const char*>(grad.untyped_data());
  auto* out_base = static_cast<char*>(out->untyped_data());
  const int64_t total = R * NB;
  ParallelBlocks(total, ThreadsFor(R * S, num_threads), [&](int64_t begin, int64_t end) {
    while (begin < end) {
      const int64_t row = begin / NB, b0 = begin - row * NB;
      const int64_t b1 = std::min(NB, end - row * NB);
      const int64_t at = row * S;
      Row8 r{master.typed_data() + at, mu_codes.typed_data() + at,
             mu_scales.typed_data() + row * NB, nu_codes.typed_data() + at,
             nu_scales.typed_data() + row * NB, grad_base + at * grad_bytes,
             has_out ? out_base + at * out_bytes : nullptr};
      fn(c, t, r, S, b0, b1, row < decayed_rows);
      begin = row * NB + b1;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DosJaxAdamW8Host, Adamw8Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // master (R, S)
                                  .Arg<ffi::Buffer<ffi::U8>>()  // mu codes (R, S)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mu scales (R, NB)
                                  .Arg<ffi::Buffer<ffi::U8>>()  // nu codes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // nu scales
                                  .Arg<ffi::AnyBuffer>()  // grad (R, S) f32 or bf16
                                  .Arg<ffi::Buffer<ffi::F32>>()  // coefficients
                                  .Arg<ffi::Buffer<ffi::F32>>()  // maps (2, 256)
                                  .Arg<ffi::Buffer<ffi::U32>>()  // encoding (2, 2, stride)
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()  // out (R, S) or empty
                                  .Attr<int64_t>("decayed_rows")
                                  .Attr<int64_t>("num_threads")
                                  .Attr<bool>("nesterov")
                                  .Attr<int64_t>("isa"));

DOS_HANDLER_CAPSULE(Handler, DosJaxAdamW8Host)

static PyMethodDef kMethods[] = {
    {"handler", Handler, METH_NOARGS, "The XLA FFI handler of the 8-bit-moment host AdamW."},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_host_adamw8",
                              "Native host AdamW with block-wise 8-bit moments (XLA FFI).",
                              -1, kMethods};

PyMODINIT_FUNC PyInit__host_adamw8() { return PyModule_Create(&kModule); }
