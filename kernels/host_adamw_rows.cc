// Native AdamW over chosen rows of the stacked optimizer state: an XLA FFI custom call
// for the CPU platform, the host path of the offloaded transform in one call per step.
//
// The state is one f32 (G, K, S) array (dos_jax/slots.py): per subgroup g, K rows of S
// elements, among them the fp32 master (when params are 16-bit), mu and nu. One call
// updates the subgroups listed in `rows`, in place, and leaves every other subgroup
// untouched. All R * S elements are split over the threads at once, so a call on many
// small subgroups is as parallel as a call on one large one.
//
// The element types, their rounding and the coefficient slots are adamw_loop.h's; the
// row loop (`SelectRows`) is adamw_rows.h's, shared with the disk kernel
// (host_adamw_disk.cc); the checks and thread split every form of this call shares
// (`Prepare`, `ForEachSegment`) are adamw_rows_setup.h's; the ISA dispatch, denormal flushing and thread split are
// adamw_common.h's. The loop follows the same rules (explicit FMAs where XLA:CPU
// contracts, reciprocal multiplies, denormals flushed), so results agree bit for bit
// with the XLA row loop of dos_jax and with jax.jit(optax.adamw) (see adamw_loop.h).

#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "adamw_loop.h"
#include "adamw_rows.h"
#include "adamw_rows_setup.h"
#include "xla/ffi/api/ffi.h"
#include "pjrt_register.h"
#include "undo_store.h"

namespace ffi = xla::ffi;

namespace {

using namespace dos_jax_host_adamw;  // NOLINT: the shared loop's internals

ffi::Error RowsBody(ffi::Buffer<ffi::F32> stacked, ffi::AnyBuffer grads,
                    ffi::Buffer<ffi::F32> params, ffi::Buffer<ffi::S32> rows,
                    ffi::Buffer<ffi::F32> coeffs, ffi::ResultBuffer<ffi::F32> stacked_out,
                    ffi::Result<ffi::AnyBuffer> out, int64_t master_k, int64_t mu_k,
                    int64_t nu_k, int64_t decayed_rows, bool indexed, int64_t num_threads,
                    bool nesterov, int64_t isa, bool out_in) {
  Setup su;
  const int64_t dims = stacked.dimensions().size();
  if (dims == 3) {
    const int64_t G = stacked.dimensions()[0], S = stacked.dimensions()[2];
    const int64_t io_rows = indexed ? G : static_cast<int64_t>(rows.element_count());
    if (static_cast<int64_t>(grads.element_count()) != io_rows * S) {
      return Invalid("grads must be (R, S), or (G, S) when indexed");
    }
    if (static_cast<int64_t>(out->element_count()) != io_rows * S) {
      return Invalid("out must be (R, S), or (G, S) when indexed");
    }
    if (master_k < 0 && static_cast<int64_t>(params.element_count()) != io_rows * S) {
      return Invalid("params rows are needed without a master slot");
    }
  }
  if (ffi::Error e = Prepare(stacked, rows, coeffs, grads.element_type(),
                             stacked_out->typed_data(), out->element_type(), master_k,
                             mu_k, nu_k, decayed_rows, num_threads, nesterov, isa, su);
      e.failure()) {
    return e;
  }
  su.out = static_cast<char*>(out->untyped_data());
  if (!out_in) AdviseHugePages(su.out, out->size_bytes());
  const Coeffs c(coeffs.typed_data());
  const size_t grad_bytes = ffi::ByteWidth(grads.element_type());
  auto* grad_base = static_cast<const char*>(grads.untyped_data());
  const float* param_base = params.typed_data();
  ForEachSegment(su, [&](int64_t j, int64_t g, int64_t begin, int64_t end) {
    const int64_t io = (indexed ? g : j) * su.S;
    RowPointers p = StateAt(su, g, 0);
    p.grad = grad_base + io * grad_bytes;
    p.param = su.has_master ? nullptr : param_base + io;
    p.out = su.out + io * su.out_bytes;
    su.fn(c, p, begin, end, g < su.decayed_rows);
  });
  return ffi::Error::Success();
}

ffi::Error RowsImpl(ffi::Buffer<ffi::F32> stacked, ffi::AnyBuffer grads,
                    ffi::Buffer<ffi::F32> params, ffi::Buffer<ffi::S32> rows,
                    ffi::Buffer<ffi::F32> coeffs, ffi::ResultBuffer<ffi::F32> stacked_out,
                    ffi::Result<ffi::AnyBuffer> out, int64_t master_k, int64_t mu_k,
                    int64_t nu_k, int64_t decayed_rows, bool indexed, int64_t num_threads,
                    bool nesterov, int64_t isa) {
  return RowsBody(stacked, grads, params, rows, coeffs, stacked_out, out, master_k, mu_k,
                  nu_k, decayed_rows, indexed, num_threads, nesterov, isa, /*out_in=*/false);
}

ffi::Error RowsOutInImpl(ffi::Buffer<ffi::F32> stacked, ffi::AnyBuffer grads,
                         ffi::Buffer<ffi::F32> params, ffi::Buffer<ffi::S32> rows,
                         ffi::Buffer<ffi::F32> coeffs, ffi::AnyBuffer /*out_in*/,
                         ffi::ResultBuffer<ffi::F32> stacked_out,
                         ffi::Result<ffi::AnyBuffer> out, int64_t master_k, int64_t mu_k,
                         int64_t nu_k, int64_t decayed_rows, bool indexed,
                         int64_t num_threads, bool nesterov, int64_t isa) {
  return RowsBody(stacked, grads, params, rows, coeffs, stacked_out, out, master_k, mu_k,
                  nu_k, decayed_rows, indexed, num_threads, nesterov, isa, /*out_in=*/true);
}

// The leaves form: gradients (and, without a master, params) are read from the
// parameter tree's leaves where they lie, not from packed (G, S) rows. Leaf i holds the
// flat elements [offsets[i], offsets[i] + sizes[i]) of the (G * S) vector; leaves are
// sorted by offset. Elements between leaves are padding: zero in the state, never read
// from out, so they are skipped.
// Out is one (G, S) array indexed by subgroup.
ffi::Error LeavesCommon(ffi::Buffer<ffi::F32>& stacked, ffi::Buffer<ffi::S32>& rows,
                        ffi::Buffer<ffi::F32>& coeffs, ffi::RemainingArgs& leaves,
                        float* state_out, ffi::DataType out_type, char* out_rows,
                        ffi::Span<const int64_t> offsets, ffi::Span<const int64_t> sizes,
                        size_t extra_args, int64_t master_k, int64_t mu_k, int64_t nu_k,
                        int64_t decayed_rows, int64_t num_threads, bool nesterov,
                        int64_t isa, float* undo = nullptr,
                        const float* restore = nullptr) {
  const size_t n = offsets.size();
  const size_t sources = master_k >= 0 ? n : 2 * n;  // grad leaves, then param leaves
  if (n == 0 || sizes.size() != n || leaves.size() != sources + extra_args) {
    return Invalid("leaves, offsets and sizes do not match");
  }
  std::vector<const char*> grad(n);
  std::vector<const float*> param(n, nullptr);
  std::vector<int64_t> ends(n);
  ffi::DataType grad_type = ffi::DataType::INVALID;
  for (size_t i = 0; i < n; ++i) {
    auto g = leaves.get<ffi::AnyBuffer>(i);
    if (!g.has_value()) return g.error();
    if (i == 0) grad_type = g->element_type();
    if (g->element_type() != grad_type || static_cast<int64_t>(g->element_count()) != sizes[i]) {
      return Invalid("gradient leaves must share one dtype and match sizes");
    }
    grad[i] = static_cast<const char*>(g->untyped_data());
    ends[i] = offsets[i] + sizes[i];
    if (i > 0 && offsets[i] < ends[i - 1]) return Invalid("leaves overlap or are unsorted");
    if (master_k < 0) {
      auto p = leaves.get<ffi::Buffer<ffi::F32>>(n + i);
      if (!p.has_value()) return p.error();
      if (static_cast<int64_t>(p->element_count()) != sizes[i]) {
        return Invalid("param leaves must be f32 and match sizes");
      }
      param[i] = p->typed_data();
    }
  }
  const auto dims = stacked.dimensions();
  if (dims.size() == 3 && ends[n - 1] > dims[0] * dims[2]) {
    return Invalid("leaves beyond the state");
  }
  Setup su;
  if (ffi::Error e = Prepare(stacked, rows, coeffs, grad_type, state_out, out_type,
                             master_k, mu_k, nu_k, decayed_rows, num_threads, nesterov,
                             isa, su);
      e.failure()) {
    return e;
  }
  su.out = out_rows;
  const Coeffs c(coeffs.typed_data());
  const size_t grad_bytes = ffi::ByteWidth(grad_type);
  ForEachSegment(su, [&](int64_t, int64_t g, int64_t begin, int64_t end) {
    const int64_t row = g * su.S, f0 = row + begin, f1 = row + end;
    const bool decay = g < su.decayed_rows;
    size_t i = std::upper_bound(ends.begin(), ends.end(), f0) - ends.begin();
    for (; i < n && offsets[i] < f1; ++i) {
      const int64_t a = std::max(f0, offsets[i]), b = std::min(f1, ends[i]);
      if (a >= b) continue;
      {
        if (undo != nullptr || restore != nullptr) {
          // The segment's state slots before the update (undo), or put back from a
          // copy taken before an earlier update of it (restore).
          for (int64_t k : {su.has_master ? su.master_k : int64_t{-1}, su.mu_k, su.nu_k}) {
            if (k < 0) continue;
            const int64_t at = (g * su.K + k) * su.S + (a - row);
            if (restore != nullptr) {
              std::memcpy(su.state + at, restore + at, (b - a) * sizeof(float));
            } else {
              std::memcpy(undo + at, su.state + at, (b - a) * sizeof(float));
            }
          }
        }
        RowPointers p = StateAt(su, g, a - row);
        p.grad = grad[i] + (a - offsets[i]) * grad_bytes;
        p.param = su.has_master ? nullptr : param[i] + (a - offsets[i]);
        p.out = su.out + a * su.out_bytes;
        su.fn(c, p, 0, b - a, decay);
      }
    }
  });
  return ffi::Error::Success();
}

// Out as (G, S) rows (see LeavesCommon); with `out_in`, the last argument is a buffer
// XLA aliases to out.
ffi::Error LeavesImpl(ffi::Buffer<ffi::F32> stacked, ffi::Buffer<ffi::S32> rows,
                      ffi::Buffer<ffi::F32> coeffs, ffi::RemainingArgs leaves,
                      ffi::ResultBuffer<ffi::F32> stacked_out,
                      ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> offsets,
                      ffi::Span<const int64_t> sizes, bool out_in, int64_t master_k,
                      int64_t mu_k, int64_t nu_k, int64_t decayed_rows,
                      int64_t num_threads, bool nesterov, int64_t isa) {
  const auto dims = stacked.dimensions();
  if (dims.size() == 3 && static_cast<int64_t>(out->element_count()) != dims[0] * dims[2]) {
    return Invalid("out is not (G, S)");
  }
  if (!out_in) AdviseHugePages(out->untyped_data(), out->size_bytes());
  return LeavesCommon(stacked, rows, coeffs, leaves, stacked_out->typed_data(),
                      out->element_type(),
                      static_cast<char*>(out->untyped_data()), offsets, sizes,
                      out_in ? 1 : 0, master_k, mu_k, nu_k, decayed_rows, num_threads,
                      nesterov, isa);
}

// Out as (G, S) rows, the state updated in its argument's own buffer: no state result.
// For the two-memory program's host region. XLA gives an asynchronous host call's
// results buffers of their own, separate from its arguments' (it cannot alias them), so
// a state result there costs a host->host copy of the state into the donated buffer on
// every step; written in the argument, the state needs no result. The caller must hand
// over a buffer it may overwrite (the donated state) and read the new state only after
// this call (dos_jax.step.kernel_calls.host_region_update passes the state through an optimization
// barrier with `out`).
ffi::Error LeavesStateArgImpl(ffi::Buffer<ffi::F32> stacked, ffi::Buffer<ffi::S32> rows,
                              ffi::Buffer<ffi::F32> coeffs, ffi::RemainingArgs leaves,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Span<const int64_t> offsets,
                              ffi::Span<const int64_t> sizes, int64_t master_k,
                              int64_t mu_k, int64_t nu_k, int64_t decayed_rows,
                              int64_t num_threads, bool nesterov, int64_t isa) {
  const auto dims = stacked.dimensions();
  if (dims.size() == 3 && static_cast<int64_t>(out->element_count()) != dims[0] * dims[2]) {
    return Invalid("out is not (G, S)");
  }
  AdviseHugePages(out->untyped_data(), out->size_bytes());
  return LeavesCommon(stacked, rows, coeffs, leaves, stacked.typed_data(),
                      out->element_type(), static_cast<char*>(out->untyped_data()),
                      offsets, sizes, 0, master_k, mu_k, nu_k, decayed_rows, num_threads,
                      nesterov, isa);
}

// The state-argument form keeping what it needs to undo: before a segment of the state
// is updated, its slots are copied into the undo copy this library keeps for the state
// buffer (undo_store.h; elements of rows not updated are left unwritten). For an update
// made before its clip factor is known (dos_jax.step.early_calls): LeavesRedoImpl puts
// the copy back and updates again.
ffi::Error LeavesStateArgUndoImpl(ffi::Buffer<ffi::F32> stacked, ffi::Buffer<ffi::S32> rows,
                                  ffi::Buffer<ffi::F32> coeffs, ffi::RemainingArgs leaves,
                                  ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Span<const int64_t> offsets,
                                  ffi::Span<const int64_t> sizes, int64_t master_k,
                                  int64_t mu_k, int64_t nu_k, int64_t decayed_rows,
                                  int64_t num_threads, bool nesterov, int64_t isa) {
  const auto dims = stacked.dimensions();
  if (dims.size() == 3 && static_cast<int64_t>(out->element_count()) != dims[0] * dims[2]) {
    return Invalid("out is not (G, S)");
  }
  AdviseHugePages(out->untyped_data(), out->size_bytes());
  float* undo = Undos().Keep(stacked.untyped_data(), stacked.element_count());
  return LeavesCommon(stacked, rows, coeffs, leaves, stacked.typed_data(),
                      out->element_type(), static_cast<char*>(out->untyped_data()),
                      offsets, sizes, 0, master_k, mu_k, nu_k, decayed_rows, num_threads,
                      nesterov, isa, undo);
}

// Redoes an update made by LeavesStateArgUndoImpl on the same state buffer when `redo`
// (an s32[1] argument after the leaves) is non-zero: each segment's state is put back
// from the kept copy and updated with these coefficients, the state in its argument's
// buffer (the caller's to overwrite, read only after this call) and the out rows in the
// `out` result. With `redo` zero it touches nothing, `out` included (the caller then
// keeps the out rows of the call it would have redone). Either way the copy is handed
// back. One result: XLA names a host call after its last instruction, and a second
// result's get-tuple-element carries no attributes.
ffi::Error LeavesRedoImpl(ffi::Buffer<ffi::F32> stacked, ffi::Buffer<ffi::S32> rows,
                          ffi::Buffer<ffi::F32> coeffs, ffi::RemainingArgs leaves,
                          ffi::Result<ffi::AnyBuffer> out,
                          ffi::Span<const int64_t> offsets, ffi::Span<const int64_t> sizes,
                          int64_t master_k, int64_t mu_k, int64_t nu_k,
                          int64_t decayed_rows, int64_t num_threads, bool nesterov,
                          int64_t isa) {
  const size_t n = offsets.size();
  const size_t sources = master_k >= 0 ? n : 2 * n;
  if (leaves.size() != sources + 1) return Invalid("leaves and redo do not match");
  auto redo = leaves.get<ffi::Buffer<ffi::S32>>(sources);
  if (!redo.has_value()) return redo.error();
  if (redo->element_count() != 1) return Invalid("redo is not (1,)");
  const auto dims = stacked.dimensions();
  if (dims.size() == 3 && static_cast<int64_t>(out->element_count()) != dims[0] * dims[2]) {
    return Invalid("out is not (G, S)");
  }
  const void* key = stacked.untyped_data();
  if (redo->typed_data()[0] == 0) {
    Undos().Release(key);
    return ffi::Error::Success();
  }
  const float* undo = Undos().Find(key, stacked.element_count());
  if (undo == nullptr) {
    return Invalid("no undo copy is kept for this state: its speculated update did not run");
  }
  ffi::Error e = LeavesCommon(stacked, rows, coeffs, leaves, stacked.typed_data(),
                              out->element_type(), static_cast<char*>(out->untyped_data()),
                              offsets, sizes, 1, master_k, mu_k, nu_k, decayed_rows,
                              num_threads, nesterov, isa, nullptr, undo);
  Undos().Release(key);
  return e;
}

}  // namespace

// `out_in` (the second handler) is a buffer XLA aliases to `out`: rows of `out` that
// the call does not update keep their values (the indexed form writes only the listed
// rows of a (G, S) array that the device path has filled in).
#define DOS_ROWS_BINDING(...)                                     \
  ffi::Ffi::Bind()                                                \
      .Arg<ffi::Buffer<ffi::F32>>() /* stacked (G, K, S) */       \
      .Arg<ffi::AnyBuffer>() /* grads */                          \
      .Arg<ffi::Buffer<ffi::F32>>() /* params (or empty) */       \
      .Arg<ffi::Buffer<ffi::S32>>() /* rows (R,) */               \
      .Arg<ffi::Buffer<ffi::F32>>() /* coefficients */            \
      __VA_ARGS__                                                 \
      .Ret<ffi::Buffer<ffi::F32>>() /* stacked (aliased) */       \
      .Ret<ffi::AnyBuffer>() /* out */                            \
      .Attr<int64_t>("master_k")                                  \
      .Attr<int64_t>("mu_k")                                      \
      .Attr<int64_t>("nu_k")                                      \
      .Attr<int64_t>("decayed_rows")                              \
      .Attr<bool>("indexed")                                      \
      .Attr<int64_t>("num_threads")                               \
      .Attr<bool>("nesterov")                                     \
      .Attr<int64_t>("isa")

XLA_FFI_DEFINE_HANDLER_SYMBOL(DosJaxAdamWHostRows, RowsImpl, DOS_ROWS_BINDING());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DosJaxAdamWHostRowsOutIn, RowsOutInImpl,
                              DOS_ROWS_BINDING(.Arg<ffi::AnyBuffer>() /* out_in */));

// Leaves forms: stacked, rows, coefficients, then the gradient leaves, the param leaves
// (without a master) and the form's extra arguments; `RETS` are the form's results, and
// the attributes after `sizes` (`out_in` for the first form) come in as `__VA_ARGS__`.
#define DOS_LEAVES_BINDING(RETS, ...)                             \
  ffi::Ffi::Bind()                                                \
      .Arg<ffi::Buffer<ffi::F32>>() /* stacked (G, K, S) */       \
      .Arg<ffi::Buffer<ffi::S32>>() /* rows (R,) */               \
      .Arg<ffi::Buffer<ffi::F32>>() /* coefficients */            \
      .RemainingArgs() RETS                                       \
      .Attr<ffi::Span<const int64_t>>("offsets")                  \
      .Attr<ffi::Span<const int64_t>>("sizes") __VA_ARGS__        \
      .Attr<int64_t>("master_k")                                  \
      .Attr<int64_t>("mu_k")                                      \
      .Attr<int64_t>("nu_k")                                      \
      .Attr<int64_t>("decayed_rows")                              \
      .Attr<int64_t>("num_threads")                               \
      .Attr<bool>("nesterov")                                     \
      .Attr<int64_t>("isa")

// Out as (G, S) rows, with the state a result aliased to its argument; with `out_in`, a
// last argument XLA aliases to out.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    DosJaxAdamWHostLeaves, LeavesImpl,
    DOS_LEAVES_BINDING(.Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::AnyBuffer>(),
                       .Attr<bool>("out_in")));

// Updating the state in its argument (no state result, see LeavesStateArgImpl).
XLA_FFI_DEFINE_HANDLER_SYMBOL(DosJaxAdamWHostLeavesStateArg, LeavesStateArgImpl,
                              DOS_LEAVES_BINDING(.Ret<ffi::AnyBuffer>()));

// The same keeping an undo copy, and its redo (see LeavesStateArgUndoImpl, LeavesRedoImpl).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    DosJaxAdamWHostLeavesStateArgUndo, LeavesStateArgUndoImpl,
    DOS_LEAVES_BINDING(.Ret<ffi::AnyBuffer>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DosJaxAdamWHostLeavesRedo, LeavesRedoImpl,
                              DOS_LEAVES_BINDING(.Ret<ffi::AnyBuffer>()));

DOS_HANDLER_CAPSULE(Handler, DosJaxAdamWHostRows)
DOS_HANDLER_CAPSULE(HandlerOutIn, DosJaxAdamWHostRowsOutIn)
DOS_HANDLER_CAPSULE(HandlerLeaves, DosJaxAdamWHostLeaves)
DOS_HANDLER_CAPSULE(HandlerLeavesStateArg, DosJaxAdamWHostLeavesStateArg)
DOS_HANDLER_CAPSULE(HandlerLeavesStateArgUndo, DosJaxAdamWHostLeavesStateArgUndo)
DOS_HANDLER_CAPSULE(HandlerLeavesRedo, DosJaxAdamWHostLeavesRedo)


namespace {

// For tests only (tests/test_pjrt_register.py): the row-wise handler, except that the
// metadata it reports claims XLA FFI API version 0.99, newer than any runtime accepts.
// XLA asks a handler for its metadata when it is registered (a call frame whose
// extension chain starts with XLA_FFI_Metadata_Extension) and refuses versions it does
// not support: jaxlib's registry says so, a PJRT plugin's FFI extension drops the
// handler and reports success. This is how a library built against newer FFI headers
// than the runtime's looks to that runtime.
XLA_FFI_Error* HandlerReportingApi099(XLA_FFI_CallFrame* call_frame) {
  XLA_FFI_Error* error = DosJaxAdamWHostRows(call_frame);
  auto* ext = call_frame->extension_start;  // its type was renamed in FFI API 0.4
  if (error == nullptr && ext != nullptr && ext->type == XLA_FFI_Extension_Metadata) {
    auto* metadata = reinterpret_cast<XLA_FFI_Metadata_Extension*>(ext)->metadata;
    if (metadata != nullptr) {
      metadata->api_version.major_version = 0;
      metadata->api_version.minor_version = 99;
    }
  }
  return error;
}

}  // namespace

// _test_handler_api_0_99() -> capsule: see HandlerReportingApi099.
PyObject* DosJaxTestHandlerApi099(PyObject* /*self*/, PyObject* /*args*/) {
  return PyCapsule_New(reinterpret_cast<void*>(&HandlerReportingApi099), nullptr, nullptr);
}

static PyMethodDef kMethods[] = {
    {"handler", Handler, METH_NOARGS, "The XLA FFI handler of the row-wise host AdamW."},
    {"handler_out_in", HandlerOutIn, METH_NOARGS,
     "The same, taking a buffer to alias to the out rows."},
    {"handler_leaves", HandlerLeaves, METH_NOARGS,
     "The same, reading gradients and params from the parameter tree's leaves."},
    {"handler_leaves_state_arg", HandlerLeavesStateArg, METH_NOARGS,
     "The leaves form, updating the state in its argument's buffer (no state result)."},
    {"handler_leaves_state_arg_undo", HandlerLeavesStateArgUndo, METH_NOARGS,
     "The same, keeping a copy of each segment's state before updating it (its undo)."},
    {"handler_leaves_redo", HandlerLeavesRedo, METH_NOARGS,
     "Puts the kept undo back and updates again (state in place, out rows a result), if asked."},
    DOS_PJRT_METHODS,
    {"_test_handler_api_0_99", DosJaxTestHandlerApi099, METH_NOARGS,
     "For tests: the row-wise handler, reporting XLA FFI API version 0.99 (too new for "
     "any runtime) when XLA asks for its metadata."},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_host_adamw_rows",
                              "Native host AdamW over rows of the stacked state (XLA FFI).",
                              -1, kMethods};

PyMODINIT_FUNC PyInit__host_adamw_rows() { return PyModule_Create(&kModule); }
