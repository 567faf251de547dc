// The instruction sets this CPU can run the native host AdamW's loop with, for the
// Python side (host_adamw.supported_isas) to check a requested `isa` before a call.
//
// The answer is SupportedIsaMask from adamw_common.h, the function the kernel itself
// resolves `isa` with (host_adamw_rows.cc), so the two cannot disagree.

#include <Python.h>

#include "adamw_common.h"

static PyObject* IsaMask(PyObject*, PyObject*) {
  return PyLong_FromLongLong(dos_jax_host_adamw::SupportedIsaMask());
}

static PyMethodDef kMethods[] = {
    {"isa_mask", IsaMask, METH_NOARGS, "Bit i set: instruction set i is usable here."},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_host_isa",
                              "Instruction sets of the native host AdamW's loop.", -1,
                              kMethods};

PyMODINIT_FUNC PyInit__host_isa() { return PyModule_Create(&kModule); }
