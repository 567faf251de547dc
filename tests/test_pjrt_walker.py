"""The C walker that registers the native host AdamW's FFI handlers with a PJRT plugin
(kernels/pjrt_register.cc's `register_with_pjrt`), against a fake `PJRT_Api` built with
ctypes: an extension chain whose FFI extension records what `register_handler` is given.
It registers every target for the host platform, from an address or a capsule; a plugin
error is the reason and is freed; an unusable plugin or a bad pointer gives a reason, not
a crash. `FakePlugin` and `capsule` also serve tests/test_pjrt_register.py's routes.
"""

from __future__ import annotations

import ctypes

import pytest

from dos_jax.kernels import _pjrt
from dos_jax.kernels import host_adamw_rows

pytestmark = pytest.mark.skipif(
    not host_adamw_rows.rows_kernel_available(),
    reason=f'not available: {host_adamw_rows.rows_kernel_unavailable_reason()}')

FFI_TYPE = 5  # PJRT_Extension_Type_FFI
LAYOUTS_TYPE = 4  # PJRT_Extension_Type_Layouts: any other extension


# --- a fake PJRT_Api: the leading fields of xla/pjrt/c/pjrt_c_api.h's structs -----------

class _RegisterArgs(ctypes.Structure):
  _fields_ = [('struct_size', ctypes.c_size_t), ('target_name', ctypes.c_void_p),
              ('target_name_size', ctypes.c_size_t), ('handler', ctypes.c_void_p),
              ('platform_name', ctypes.c_void_p), ('platform_name_size', ctypes.c_size_t),
              ('traits', ctypes.c_uint32)]


class _MessageArgs(ctypes.Structure):
  _fields_ = [('struct_size', ctypes.c_size_t), ('extension_start', ctypes.c_void_p),
              ('error', ctypes.c_void_p), ('message', ctypes.c_void_p),
              ('message_size', ctypes.c_size_t)]


class _DestroyArgs(ctypes.Structure):
  _fields_ = [('struct_size', ctypes.c_size_t), ('extension_start', ctypes.c_void_p),
              ('error', ctypes.c_void_p)]


_REGISTER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_RegisterArgs))
_MESSAGE = ctypes.CFUNCTYPE(None, ctypes.POINTER(_MessageArgs))
_DESTROY = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DestroyArgs))


class _Extension(ctypes.Structure):  # PJRT_Extension_Base + the FFI extension's fields
  _fields_ = [('struct_size', ctypes.c_size_t), ('type', ctypes.c_int32),
              ('next', ctypes.c_void_p), ('type_register', ctypes.c_void_p),
              ('user_data_add', ctypes.c_void_p), ('register_handler', _REGISTER)]


class _Api(ctypes.Structure):
  _fields_ = [('struct_size', ctypes.c_size_t), ('extension_start', ctypes.c_void_p),
              ('version_struct_size', ctypes.c_size_t),
              ('version_extension_start', ctypes.c_void_p), ('major', ctypes.c_int),
              ('minor', ctypes.c_int), ('error_destroy', _DESTROY),
              ('error_message', _MESSAGE), ('rest', ctypes.c_void_p * 120)]


class FakePlugin:
  """A PJRT_Api whose extension chain is `types` (FFI_TYPE marks the FFI extension).

  `calls` records every register_handler call as (target, handler, platform, traits,
  struct_size); with `fail_with`, register_handler returns an error with that message.
  """

  def __init__(self, types_=(LAYOUTS_TYPE, FFI_TYPE), *, ffi_size=48, fail_with=None,
               major=0):
    self.calls = []
    self.destroyed = []
    self._message = ctypes.create_string_buffer((fail_with or '').encode())
    self._error = ctypes.create_string_buffer(8)  # any non-null address
    self._fail = fail_with is not None
    self._callbacks = (_REGISTER(self._register), _MESSAGE(self._error_message),
                       _DESTROY(self._error_destroy))
    self.extensions = [_Extension(struct_size=ffi_size if t == FFI_TYPE else 24, type=t)
                       for t in types_]
    for ext in self.extensions:
      if ext.type == FFI_TYPE:
        ext.register_handler = self._callbacks[0]
    for a, b in zip(self.extensions, self.extensions[1:]):
      a.next = ctypes.addressof(b)
    self.api = _Api(struct_size=ctypes.sizeof(_Api), version_struct_size=24, major=major,
                    minor=90, error_destroy=self._callbacks[2],
                    error_message=self._callbacks[1])
    if self.extensions:
      self.api.extension_start = ctypes.addressof(self.extensions[0])

  @property
  def address(self) -> int:
    return ctypes.addressof(self.api)

  def _register(self, args):
    a = args.contents
    self.calls.append((ctypes.string_at(a.target_name, a.target_name_size).decode(),
                       a.handler, ctypes.string_at(a.platform_name,
                                                   a.platform_name_size).decode(),
                       a.traits, a.struct_size))
    return ctypes.addressof(self._error) if self._fail else None

  def _error_message(self, args):
    a = args.contents
    assert a.error == ctypes.addressof(self._error)
    a.message = ctypes.addressof(self._message)
    a.message_size = len(self._message.value)

  def _error_destroy(self, args):
    self.destroyed.append(args.contents.error)


def _capsule_pointer(capsule) -> int:
  get = ctypes.pythonapi.PyCapsule_GetPointer
  get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
  return get(capsule, None)


_CAPSULE_NAME = b'pjrt_c_api'  # lives as long as the module: capsules point at it


def capsule(address: int):
  """A named capsule holding `address`, as JAX's PJRT_Api capsules are."""
  new = ctypes.pythonapi.PyCapsule_New
  new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                  ctypes.c_void_p]
  return new(address, _CAPSULE_NAME, None)


def _native():
  return host_adamw_rows._load()[0]  # pylint: disable=protected-access


def _handlers():
  return host_adamw_rows._HANDLERS  # pylint: disable=protected-access


def _pairs():
  native = _native()
  return [(name, getattr(native, fn)()) for name, fn in _handlers().items()]


# --- the C walker -----------------------------------------------------------------------

@pytest.mark.parametrize('as_capsule', [False, True], ids=['int', 'capsule'])
def test_registers_every_target_for_host(as_capsule):
  plugin = FakePlugin((0, 3, LAYOUTS_TYPE, FFI_TYPE, 6))
  api = capsule(plugin.address) if as_capsule else plugin.address
  assert _native().register_with_pjrt(api, 'Host', _pairs()) == ''
  want = [(name, _capsule_pointer(handler), 'Host', 0, 52) for name, handler in _pairs()]
  assert plugin.calls == want
  assert {c[0] for c in plugin.calls} == set(_handlers())


def test_python_side_registers_the_module_handlers():
  plugin = FakePlugin()
  assert _pjrt.register(_native(), _handlers(), 'cuda', plugin.address) == ''
  assert [c[0] for c in plugin.calls] == list(_handlers())
  assert all(c[2] == _pjrt.HOST_PLATFORM == 'Host' for c in plugin.calls)


def test_plugin_error_is_the_reason_and_is_freed():
  plugin = FakePlugin(fail_with='duplicate registration, say')
  why = _native().register_with_pjrt(plugin.address, 'Host', _pairs())
  assert 'dos_jax_adamw_host_rows' in why and 'duplicate registration, say' in why
  assert len(plugin.calls) == 1  # stops at the first failure
  assert plugin.destroyed == [ctypes.addressof(plugin._error)]  # pylint: disable=protected-access


@pytest.mark.parametrize('plugin,reason', [
    (FakePlugin((LAYOUTS_TYPE, 0)), 'no PJRT FFI extension'),
    (FakePlugin(()), 'no PJRT FFI extension'),
    (FakePlugin(ffi_size=40), 'no register_handler'),  # FFI extension version 1
    (FakePlugin(major=1), 'major version'),
], ids=['no_ffi', 'no_extensions', 'old_ffi', 'major_1'])
def test_unusable_plugin_gives_a_reason(plugin, reason):
  why = _native().register_with_pjrt(plugin.address, 'Host', _pairs())
  assert reason in why
  assert not plugin.calls


def test_bad_pointers_give_reasons_not_crashes():
  native = _native()
  assert 'null' in native.register_with_pjrt(0, 'Host', _pairs())
  tiny = FakePlugin()
  tiny.api.struct_size = 16
  assert 'too small' in native.register_with_pjrt(tiny.address, 'Host', _pairs())
  cycle = FakePlugin((LAYOUTS_TYPE, 0))
  cycle.extensions[-1].next = ctypes.addressof(cycle.extensions[0])
  assert 'does not end' in native.register_with_pjrt(cycle.address, 'Host', _pairs())
  plugin = FakePlugin()
  assert 'null handler' in native.register_with_pjrt(plugin.address, 'Host', [('x', 0)])
  assert 'empty platform' in native.register_with_pjrt(plugin.address, '', _pairs())
  assert not plugin.calls
  with pytest.raises(TypeError):
    native.register_with_pjrt('not a pointer', 'Host', _pairs())
  with pytest.raises(TypeError):
    native.register_with_pjrt(plugin.address, 'Host', [['x', 1]])
