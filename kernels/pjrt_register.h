// What pjrt_register.cc adds to a native library's Python module: registering its XLA
// FFI handlers inside a PJRT plugin, for GPU programs' host regions (kernels/_pjrt.py).

#ifndef DOS_JAX_KERNELS_PJRT_REGISTER_H_
#define DOS_JAX_KERNELS_PJRT_REGISTER_H_

#include <Python.h>

PyObject* DosJaxRegisterWithPjrt(PyObject* self, PyObject* args);
PyObject* DosJaxFfiApiVersion(PyObject* self, PyObject* args);

// The two entries of a module's method table.
#define DOS_PJRT_METHODS                                                                  \
  {"register_with_pjrt", DosJaxRegisterWithPjrt, METH_VARARGS,                            \
   "register_with_pjrt(api, platform, targets) -> '' or why not: registers the "          \
   "(name, handler) targets in the FFI registry of the PJRT plugin `api` for `platform`."}, \
  {"ffi_api_version", DosJaxFfiApiVersion, METH_NOARGS,                                   \
   "ffi_api_version() -> (major, minor): the XLA FFI API version of the headers this "    \
   "library was built with (what its handlers report to XLA)."}

#endif  // DOS_JAX_KERNELS_PJRT_REGISTER_H_
