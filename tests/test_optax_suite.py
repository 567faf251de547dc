"""optax's own adamw tests (optax/_src/alias_test.py from the installed wheel), with
`optax.adamw` swapped for `dos_jax.adamw`, for the AllHost and Stride(2) policies.

The test file is read from the installed optax, its optimizer list narrowed to adamw,
and its `_get_opt` pointed at dos_jax. Deliberate differences, each skipped with its
reason: complex parameters are refused; with 16-bit parameters dos_jax keeps an fp32
master and its first moment defaults to fp32, where optax keeps it in the params' dtype.
One source edit: the params are committed before the loop, the README's one line (JAX
commits the outputs of a program that moves memory kinds, so uncommitted params make
the step compile twice; see `dos_jax.validate.warn_if_uncommitted`). Any other failure
fails the test.
Updates have optax's dtype (16-bit for 16-bit params and gradients), and
`optax.tree.map_params` runs on the offloaded state (it holds no params-shaped tree).
"""

import functools
import pathlib
import sys
import types
import unittest

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dos_jax

SOURCE = pathlib.Path(optax.__file__).parent / '_src' / 'alias_test.py'

# Source edits, each a deliberate, documented difference of dos_jax.adamw:
EDITS = (
    # Only adamw is under test.
    (None, "_OPTIMIZERS_UNDER_TEST = ({'opt_name': 'adamw', 'opt_kwargs': {'learning_rate': 1e-1}},)\n"),
    # JAX commits the outputs of a program that moves memory kinds: params must be
    # committed too (README's one line), or the step compiles once more for them.
    ('    params = initial_params\n', '    params = jax.device_put(initial_params, jax.devices()[0])\n'),
    # test_explicit_dtype also runs optax's own sgd_mom and adam: only adamw is dos_jax's.
    ("      opt_name=('sgd_mom', 'adam', 'adamw'),\n", "      opt_name=('adamw',),\n"),
    # optax's extra-args test checks only that the update does not raise; it is replaced
    # by test_update_takes_extra_args_as_optax_does below, which compares the params.
    ('  def test_optimizers_accept_extra_args(self, ',
     '  def _replaced_optimizers_accept_extra_args(self, '),
)
GUARDED = ('test_optimization', 'test_explicit_dtype', 'test_preserve_dtype',
           'test_state_shape_dtype_shard_stability', 'test_gradient_accumulation')


def skip_deliberate_differences(test, **params):
  """Complex params are refused; 16-bit params get an fp32 master and, when no
  `mu_dtype` is given, an fp32 first moment (optax: the params' dtype). Only
  `test_explicit_dtype` with `state_dtype=None` tells that default apart."""
  if params.get('opt_name', 'adamw') != 'adamw':
    return  # optax's own optimizers in a shared test: run them as they are
  dtypes = [params.get(k) for k in ('params_dtype', 'state_dtype', 'dtype')]
  for value in dtypes:
    name = jnp.dtype(value).name if value is not None else ''
    if 'complex' in name:
      raise unittest.SkipTest('complex parameters are refused by dos_jax')
  dtype = params.get('params_dtype')
  if (test._testMethodName.startswith('test_explicit_dtype') and params.get('state_dtype') is None
      and dtype is not None and jnp.dtype(dtype).itemsize == 2):
    # Only the default differs: an explicit `mu_dtype` is honoured for 16-bit params too.
    raise unittest.SkipTest('16-bit params, no mu_dtype: dos_jax keeps its first moment in fp32')


def _load_suite() -> types.ModuleType:
  text = SOURCE.read_text()
  start = text.index('_OPTIMIZERS_UNDER_TEST = (')
  end = text.index('\n)\n', start) + 3
  text = text[:start] + EDITS[0][1] + text[end:]
  for old, new in EDITS[1:]:
    assert old in text, f'optax test source changed: {old!r}'
    text = text.replace(old, new)
  for name in GUARDED:
    header = f'  def {name}(self, '
    head = text.index(header)
    body = text.index('):\n', head) + 3
    args = text[head + len(header):body - 3]
    names = [a.split(':')[0].strip() for a in args.replace('\n', ' ').split(',') if a.strip()]
    call = ', '.join(f'{n}={n}' for n in names)
    text = text[:body] + f'    _dos_skip(self, {call})\n' + text[body:]
  module = types.ModuleType('optax_alias_suite_for_dos_jax')
  module.__file__ = str(SOURCE)
  module._dos_skip = skip_deliberate_differences  # pylint: disable=protected-access
  sys.modules[module.__name__] = module
  exec(compile(text, str(SOURCE), 'exec'), module.__dict__)  # pylint: disable=exec-used
  original = module._get_opt  # pylint: disable=protected-access

  def get_opt(self, opt_name):
    if opt_name == 'adamw':
      offload = dos_jax.Offload(subgroup_size=2, policy=self.POLICY)
      return functools.partial(dos_jax.adamw, offload=offload)
    return original(self, opt_name)

  module._get_opt = get_opt  # pylint: disable=protected-access
  return module


_suite = _load_suite()


class OptaxAdamWSuiteAllHost(_suite.AliasTest):
  """Every AliasTest case for adamw, minus the documented deliberate differences."""

  POLICY = dos_jax.AllHost()


class OptaxAdamWSuiteStride2(_suite.AliasTest):
  """The same with every other subgroup streamed to the device."""

  POLICY = dos_jax.Stride(2)


def test_update_takes_extra_args_as_optax_does(seed):
  """`update` given a keyword it does not use (optax's extra-args support) steps as
  optax.adamw does: params after three jitted steps on a random quadratic, fp32, to
  float32 rounding (rtol 1e-6, atol 1e-7)."""
  rng = np.random.default_rng(seed)
  target = jnp.asarray(rng.standard_normal(7), jnp.float32)
  start = jax.device_put(jnp.asarray(rng.standard_normal(7), jnp.float32), jax.devices()[0])

  def run(opt):
    @jax.jit
    def step(params, state):
      grads = jax.grad(lambda p: jnp.sum((p - target) ** 2))(params)
      updates, state = opt.update(grads, state, params, unexpected_extra_arg=1)
      return optax.apply_updates(params, updates), state
    params, state = start, opt.init(start)
    for _ in range(3):
      params, state = step(params, state)
    return np.asarray(params)

  for policy in (dos_jax.AllHost(), dos_jax.Stride(2)):
    ours = run(dos_jax.adamw(1e-1, offload=dos_jax.Offload(subgroup_size=2, policy=policy)))
    reference = run(optax.adamw(1e-1))
    np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=1e-7)
    assert not np.allclose(ours, np.asarray(start))
