// Registering this library's XLA FFI handlers inside a PJRT plugin, through the plugin's
// PJRT FFI extension, for a platform the plugin compiles for.
//
// Why: a GPU program's host regions (`compute_on('device_host')`) are compiled and run
// by the GPU PJRT plugin (e.g. jax_plugins/xla_cuda13/xla_cuda_plugin.so), a separate
// XLA build with its own FFI registry. `jax.ffi.register_ffi_target(..., platform='cpu')`
// registers in jaxlib's XLA only, so the plugin finds no handler for platform "Host".
// The plugin's PJRT_Api lists extensions; its FFI extension's `register_handler` takes a
// platform name, so the handlers can be registered there for "Host".
//
// jaxlib ships the XLA FFI headers but no PJRT headers, so the few structs needed are
// declared below, mirroring openxla/xla's xla/pjrt/c/pjrt_c_api.h and
// xla/pjrt/c/pjrt_c_api_ffi_extension.h as of the XLA revisions of jaxlib 0.10.2
// (openxla/xla@5a9e73cb) and 0.11.x (openxla/xla@131bf41a .. 753e5e56): PJRT C API
// major version 0, FFI extension version >= 4. Only leading fields are declared; every
// read is guarded by the struct_size the plugin reports, and nothing is ever written
// into the plugin's structs.

#define PY_SSIZE_T_CLEAN  // the s# formats below take Py_ssize_t lengths
#include <Python.h>

#include "pjrt_register.h"
#include "xla/ffi/api/c_api.h"

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

namespace {

// --- mirrored from xla/pjrt/c/pjrt_c_api.h --------------------------------------------

// PJRT_Extension_Type: Gpu_Custom_Call = 0, Profiler, Custom_Partitioner, Stream,
// Layouts, FFI, ... (a C enum: int-sized).
constexpr int32_t kExtensionTypeFfi = 5;
// PJRT_API_MAJOR: the layouts below are those of major version 0.
constexpr int kPjrtApiMajor = 0;

struct ExtensionBase {  // PJRT_Extension_Base
  size_t struct_size;
  int32_t type;  // PJRT_Extension_Type
  const ExtensionBase* next;
};

struct ApiVersion {  // PJRT_Api_Version
  size_t struct_size;
  const ExtensionBase* extension_start;
  int major_version;
  int minor_version;
};

struct Error;  // PJRT_Error (opaque)

struct ErrorDestroyArgs {  // PJRT_Error_Destroy_Args
  size_t struct_size;
  const ExtensionBase* extension_start;
  Error* error;
};

struct ErrorMessageArgs {  // PJRT_Error_Message_Args
  size_t struct_size;
  const ExtensionBase* extension_start;
  const Error* error;
  const char* message;  // out, lives as long as `error`
  size_t message_size;  // out
};

// The first fields of PJRT_Api; the real struct continues with ~100 more entries.
struct ApiPrefix {
  size_t struct_size;
  const ExtensionBase* extension_start;
  ApiVersion pjrt_api_version;
  void (*error_destroy)(ErrorDestroyArgs*);  // PJRT_Error_Destroy
  void (*error_message)(ErrorMessageArgs*);  // PJRT_Error_Message
};

// --- mirrored from xla/pjrt/c/pjrt_c_api_ffi_extension.h -----------------------------

struct RegisterHandlerArgs {  // PJRT_FFI_Register_Handler_Args
  size_t struct_size;
  const char* target_name;
  size_t target_name_size;
  void* handler;  // XLA_FFI_Handler* (typed FFI handlers only)
  const char* platform_name;
  size_t platform_name_size;
  uint32_t traits;  // PJRT_FFI_Handler_TraitsBits (a C enum: int-sized)
};
// PJRT_FFI_Register_Handler_Args_STRUCT_SIZE: offsetof(traits) + sizeof(traits). The
// plugin checks that the size we pass is at least its own, so a plugin whose struct
// differs by a grown tail (or FFI extension version 2's, which had an `int api_version`
// before `handler`: 60 bytes) refuses the call with an error instead of misreading it.
constexpr size_t kRegisterHandlerArgsSize =
    offsetof(RegisterHandlerArgs, traits) + sizeof(uint32_t);
static_assert(kRegisterHandlerArgsSize == 52, "PJRT_FFI_Register_Handler_Args layout");

struct FfiExtension {  // PJRT_FFI_Extension
  ExtensionBase base;
  void* type_register;  // PJRT_FFI_Type_Register* (not used here)
  void* user_data_add;  // PJRT_FFI_UserData_Add* (not used here)
  Error* (*register_handler)(RegisterHandlerArgs*);  // PJRT_FFI_Register_Handler*
};
// PJRT_FFI_Extension_STRUCT_SIZE: a plugin's extension without register_handler (FFI
// extension version 1) is smaller.
constexpr size_t kFfiExtensionSize = offsetof(FfiExtension, register_handler) + sizeof(void*);
static_assert(kFfiExtensionSize == 48, "PJRT_FFI_Extension layout");

// Chains longer than this are taken as corrupt (a real plugin has about a dozen).
constexpr int kMaxExtensions = 256;

// The message of `error` (freed afterwards), or a placeholder when the API cannot say.
std::string TakeError(const ApiPrefix* api, Error* error) {
  std::string message = "(the plugin gave no message)";
  if (api->error_message != nullptr) {
    ErrorMessageArgs args{sizeof(ErrorMessageArgs), nullptr, error, nullptr, 0};
    api->error_message(&args);
    if (args.message != nullptr) message.assign(args.message, args.message_size);
  }
  if (api->error_destroy != nullptr) {
    ErrorDestroyArgs args{sizeof(ErrorDestroyArgs), nullptr, error};
    api->error_destroy(&args);
  }
  return message;
}

struct Target {
  std::string name;
  void* handler;
};

// Finds the FFI extension of `raw_api` and registers every target for `platform`.
// Returns '' on success, else why not (after the first failure nothing more is tried).
std::string Register(const void* raw_api, const std::string& platform,
                     const std::vector<Target>& targets) {
  const auto* api = static_cast<const ApiPrefix*>(raw_api);
  if (api == nullptr) return "no PJRT_Api (null pointer)";
  if (api->struct_size < sizeof(ApiPrefix)) {
    return "PJRT_Api struct_size " + std::to_string(api->struct_size) +
           " is too small to be a PJRT_Api";
  }
  if (api->pjrt_api_version.major_version != kPjrtApiMajor) {
    return "PJRT C API version " + std::to_string(api->pjrt_api_version.major_version) +
           "." + std::to_string(api->pjrt_api_version.minor_version) +
           ": only major version 0's layouts are known";
  }
  if (platform.empty()) return "empty platform name";
  const ExtensionBase* ext = api->extension_start;
  int seen = 0;
  for (; ext != nullptr; ext = ext->next) {
    if (++seen > kMaxExtensions) return "the PJRT extension chain does not end";
    if (ext->struct_size < sizeof(ExtensionBase)) {
      return "malformed PJRT extension (struct_size " + std::to_string(ext->struct_size) +
             ")";
    }
    if (ext->type == kExtensionTypeFfi) break;
  }
  if (ext == nullptr) return "the plugin has no PJRT FFI extension";
  const auto* ffi = reinterpret_cast<const FfiExtension*>(ext);
  if (ffi->base.struct_size < kFfiExtensionSize ||
      ffi->register_handler == nullptr) {
    return "the plugin's PJRT FFI extension has no register_handler (struct_size " +
           std::to_string(ffi->base.struct_size) + "): plugin too old";
  }
  for (const Target& t : targets) {
    if (t.name.empty() || t.handler == nullptr) return "empty target name or null handler";
    RegisterHandlerArgs args{};
    args.struct_size = kRegisterHandlerArgsSize;
    args.target_name = t.name.data();
    args.target_name_size = t.name.size();
    args.handler = t.handler;
    args.platform_name = platform.data();
    args.platform_name_size = platform.size();
    args.traits = 0;
    if (Error* error = ffi->register_handler(&args)) {
      return "registering " + t.name + " for " + platform + " failed: " +
             TakeError(api, error);
    }
  }
  return "";
}

// A pointer from a PyCapsule (any name) or an int address; sets a Python error if not.
void* AsPointer(PyObject* obj, const char* what) {
  if (PyCapsule_CheckExact(obj)) return PyCapsule_GetPointer(obj, PyCapsule_GetName(obj));
  if (PyLong_Check(obj)) {
    void* p = PyLong_AsVoidPtr(obj);
    if (p == nullptr && !PyErr_Occurred()) return nullptr;  // 0: null pointer, no error
    return p;
  }
  PyErr_Format(PyExc_TypeError, "%s must be a PyCapsule or an int address", what);
  return nullptr;
}

}  // namespace

// ffi_api_version() -> (major, minor): the XLA FFI API of the headers this library was
// compiled with, which its handlers report to XLA (setup.py records it too).
PyObject* DosJaxFfiApiVersion(PyObject* /*self*/, PyObject* /*args*/) {
  return Py_BuildValue("(ii)", XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
}

// register_with_pjrt(api, platform, targets) -> str: see kernels/_pjrt.py.
PyObject* DosJaxRegisterWithPjrt(PyObject* /*self*/, PyObject* args) {
  PyObject* api_obj;
  const char* platform;
  Py_ssize_t platform_size;
  PyObject* targets_obj;
  if (!PyArg_ParseTuple(args, "Os#O:register_with_pjrt", &api_obj, &platform,
                        &platform_size, &targets_obj)) {
    return nullptr;
  }
  void* api = AsPointer(api_obj, "api");
  if (PyErr_Occurred()) return nullptr;
  PyObject* seq = PySequence_Fast(targets_obj, "targets must be a sequence of (name, handler) tuples");
  if (seq == nullptr) return nullptr;
  std::vector<Target> targets;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
    const char* name;
    Py_ssize_t name_size;
    PyObject* handler_obj;
    if (!PyTuple_Check(item)) {
      PyErr_SetString(PyExc_TypeError, "targets must be (name, handler) tuples");
      Py_DECREF(seq);
      return nullptr;
    }
    if (!PyArg_ParseTuple(item, "s#O:register_with_pjrt", &name, &name_size, &handler_obj)) {
      Py_DECREF(seq);
      return nullptr;
    }
    void* handler = AsPointer(handler_obj, "a handler");
    if (PyErr_Occurred()) {
      Py_DECREF(seq);
      return nullptr;
    }
    targets.push_back(Target{std::string(name, name_size), handler});
  }
  Py_DECREF(seq);
  std::string why;
  try {
    why = Register(api, std::string(platform, platform_size), targets);
  } catch (const std::exception& e) {
    why = std::string("registration raised: ") + e.what();
  }
  return PyUnicode_FromStringAndSize(why.data(), static_cast<Py_ssize_t>(why.size()));
}
