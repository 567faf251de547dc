"""Misuse of the library gets one line naming the mistake, never an internal error."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dos_jax

OFFLOAD = dos_jax.Offload(subgroup_size=64, policy=dos_jax.Stride(2))


def params_and_state(seed, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  params = {'w': jnp.asarray(rng.standard_normal((128, 8)), dtype),
            'b': jnp.asarray(rng.standard_normal((8,)), dtype)}
  tx = dos_jax.adamw(1e-3, offload=OFFLOAD)
  return tx, params, tx.init(params)


def one_line(err: pytest.ExceptionInfo) -> str:
  text = str(err.value)
  assert '\n' not in text, text
  return text


@pytest.mark.parametrize('jit', [False, True], ids=['eager', 'jit'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['fp32', 'bf16'])
def test_transposed_gradients_are_refused_naming_the_leaf(jit, dtype, seed):
  tx, params, state = params_and_state(seed, dtype)
  grads = {'w': jnp.ones((8, 128), dtype), 'b': jnp.ones((8,), dtype)}
  update = jax.jit(tx.update) if jit else tx.update
  with pytest.raises(ValueError, match=r"\['w'\] has shape mismatch.*\(8, 128\).*\(128, 8\)") as err:
    update(grads, state, params)
  one_line(err)
  # optax refuses them too: the same input is a mistake for both.
  with pytest.raises(Exception):
    optax.adamw(1e-3).update(grads, optax.adamw(1e-3).init(params), params)


def test_wrong_size_and_wrong_count_and_integer_gradients_are_refused(seed):
  tx, params, state = params_and_state(seed)
  cases = [
      ({'w': jnp.ones((128, 9)), 'b': jnp.ones(8)}, r"\['w'\] has size mismatch"),
      ({'w': jnp.ones((128, 8))}, r"have 1 leaves.*had 2: params leaf \['b'\] has no match"),
      ({'w': jnp.ones((128, 8)), 'b': jnp.ones(8), 'c': jnp.ones(2)},
       r"have 3 leaves.*had 2: updates leaf \['c'\] matches no param"),
      ({'w': jnp.ones((128, 8), jnp.int32), 'b': jnp.ones(8)}, r"\['w'\] has dtype int32"),
  ]
  for grads, pattern in cases:
    with pytest.raises(ValueError, match=pattern) as err:
      tx.update(grads, state, params)
    one_line(err)
  with pytest.raises(ValueError, match=r"params leaf \['w'\] has shape mismatch") as err:
    tx.update(jax.tree.map(jnp.ones_like, params), state,
              {'w': jnp.ones((8, 128)), 'b': jnp.ones(8)})
  one_line(err)


def test_any_updates_tree_with_matching_leaves_is_accepted(seed):
  """optax's rule: the leaves, not the node types, must match (a tuple for a dict)."""
  tx, params, state = params_and_state(seed)
  grads = jax.tree.map(jnp.ones_like, params)
  as_tuple = tuple(jax.tree.leaves(grads))
  u_dict, _ = tx.update(grads, state, params)
  u_tuple, _ = tx.update(as_tuple, state, params)
  assert isinstance(u_tuple, tuple)
  for a, b in zip(jax.tree.leaves(u_dict), u_tuple, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize('bad, pattern', [
    (None, r'init\(params\) got None'),
    ({'w': [1.0, 2.0]}, r"\['w'\]\[0\] is a float, not an array"),
    ({'w': 'weights'}, r"\['w'\] is a str, not an array"),
    ({}, 'empty'),
])
def test_init_refuses_what_is_not_a_parameter_tree(bad, pattern):
  with pytest.raises((TypeError, ValueError), match=pattern) as err:
    dos_jax.adamw(1e-3, offload=OFFLOAD).init(bad)
  one_line(err)


def test_configuration_mistakes_name_the_argument():
  with pytest.raises(TypeError, match=r'dos_jax\.Stride\(\.\.\.\), not the class Stride') as err:
    dos_jax.Offload(policy=dos_jax.Stride)
  one_line(err)
  with pytest.raises(TypeError, match=r'dos_jax\.AllHost\(\.\.\.\), not the class AllHost'):
    dos_jax.Offload(policy=dos_jax.AllHost)
  for make, name in [(lambda o: dos_jax.adamw(1e-3, offload=o), 'dos_jax.adamw'),
                     (lambda o: dos_jax.chain(optax.scale_by_adam(), offload=o), 'dos_jax.chain'),
                     (lambda o: dos_jax.offloaded(optax.scale_by_adam(), o), 'dos_jax.offloaded')]:
    with pytest.raises(TypeError, match=rf"{name}: offload must be a dos_jax.Offload.*'yes'") as err:
      make('yes')
    one_line(err)
  with pytest.raises(TypeError, match='got None'):
    dos_jax.adamw(1e-3, offload=None).init(None)
  for make, name in [(lambda i: dos_jax.adamw(1e-3, implementation=i), 'dos_jax.adamw'),
                     (lambda i: dos_jax.chain(optax.scale_by_adam(), implementation=i),
                      'dos_jax.chain'),
                     (lambda i: dos_jax.offloaded(optax.scale_by_adam(), implementation=i),
                      'dos_jax.offloaded')]:
    with pytest.raises(TypeError, match=rf"{name}: implementation must be a "
                       r"dos_jax.Implementation.*'gpu'") as err:
      make('gpu')
    one_line(err)


def test_offload_holds_only_what_a_user_decides():
  """Six fields; the program and the implementations are `Implementation`'s, the limit
  on asynchronous calls is the compile options' (`dos_jax.jit`)."""
  assert [f.name for f in dataclasses.fields(dos_jax.Offload)] == [
      'subgroup_size', 'policy', 'mesh', 'data_axis', 'host_threads', 'disk']
  assert [f.name for f in dataclasses.fields(dos_jax.Implementation)] == [
      'program', 'device', 'host', 'two_streams']


def test_implementation_names_a_bad_field_in_one_line():
  assert dos_jax.Implementation(program='gpu').program is dos_jax.Program.TWO_MEMORIES
  assert dos_jax.Implementation(program=dos_jax.Program.ONE_MEMORY).target() is \
      dos_jax.Program.ONE_MEMORY
  assert dos_jax.Implementation().target() is dos_jax.Program.of_backend(
      jax.default_backend())
  for bad in ('tpu', 1, ['gpu']):
    with pytest.raises(ValueError, match=r"Implementation\.program must be None, a "
                       rf"dos_jax\.Program, 'cpu' or 'gpu', got {bad!r}".replace('[', r'\[')
                       ) as err:
      dos_jax.Implementation(program=bad)
    one_line(err)
  for field in ('device', 'host'):
    with pytest.raises(TypeError, match=rf"Implementation\.{field} must be a "
                       r"dos_jax\.UpdateImpl, got 'xla'") as err:
      dos_jax.Implementation(**{field: 'xla'})
    one_line(err)
  with pytest.raises(TypeError, match=r"Implementation\.two_streams must be a bool, got 'no'"
                     ) as err:
    dos_jax.Implementation(two_streams='no')
  one_line(err)


def test_a_bad_limit_in_xla_flags_is_named_at_init(monkeypatch):
  monkeypatch.setenv('XLA_FLAGS', '--xla_gpu_experimental_parallel_async_compute_limit=three')
  params = jax.device_put({'w': jnp.ones((128, 8))}, jax.devices()[0])
  with pytest.raises(ValueError, match=r"XLA_FLAGS: .*parallel_async_compute_limit.*'three'") \
      as err:
    dos_jax.adamw(1e-3, offload=OFFLOAD).init(params)
  one_line(err)
