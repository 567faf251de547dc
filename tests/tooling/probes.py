"""Programs that the compiled-schedule tests and `experiments/` share.

* `host_chunks_program`: K host regions fed by a bf16 MLP's weight gradients, one chunk
  of layers each in backward order, optionally linked region to region. It shows how
  XLA:GPU groups host regions into host calls (the behaviour an early, chunked host
  update relies on; docs in experiments/host_chunks_probe.py).
* `mlp_step`: one training step of an L-layer MLP with the library's optimizer
  (`dos_jax.chain(clip_by_global_norm, adamw)`, one subgroup per layer), the family of
  shapes the compiled tests check beyond the runner's presets.

Both return `(fn, args, jit_kwargs)` for `dataflow.compile_for_gpu(fn, *args,
**jit_kwargs)`; nothing here compiles.
"""

from __future__ import annotations

import enum
from typing import Any, Callable

import numpy as np


class Link(enum.Enum):
  """How host region k+1 is tied to region k in `host_chunks_program`.

  NONE: no data flows between the regions.
  HOST: region k+1 takes a token computed in region k (host to host).
  DEVICE: region k returns a token computed from all of its outputs; a device op (a
    multiply by a value only known at run time) turns it into region k+1's input.
  """

  NONE = 'none'
  HOST = 'host'
  DEVICE = 'device'


def mlp_params(num_layers: int, width: int, dtype, seed: int = 0):
  """`{'layer<i>': {'w': (W, W), 'b': (W,)}}` in `dtype`, weights scaled by 1/sqrt(W)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  return {f'layer{i}': {'w': jnp.asarray(rng.standard_normal((width, width)) / np.sqrt(width),
                                         dtype),
                        'b': jnp.zeros((width,), dtype)} for i in range(num_layers)}


def mlp_loss(params, x):
  """Mean square of the last layer's tanh output, in float32."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  h = x
  for i in range(len(params)):
    h = jnp.tanh(h @ params[f'layer{i}']['w'] + params[f'layer{i}']['b'])
  return jnp.mean(h.astype(jnp.float32) ** 2)


def host_chunks_program(chunks: int, link: Link = Link.DEVICE, num_layers: int = 6,
                        width: int = 1024) -> tuple[Callable[..., Any], tuple, dict]:
  """A step whose `num_layers` weight gradients go to host memory one by one and are
  consumed by `chunks` host regions (the last layers first), linked by `link`."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from dos_jax import memory_spaces  # pylint: disable=import-outside-toplevel

  params = {k: v['w'] for k, v in mlp_params(num_layers, width, jnp.bfloat16).items()}
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind='pinned_host')
  rows = jax.device_put(jnp.zeros((num_layers, width * width), jnp.float32), host)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((256, width)), jnp.bfloat16)

  def loss(p, x):
    h = x
    for i in range(num_layers):
      h = jnp.tanh(h @ p[f'layer{i}'])
    return jnp.mean(h.astype(jnp.float32) ** 2)

  def step(p, rows, x):
    grads = jax.grad(loss)(p, x)
    on_host = [memory_spaces.to_host(grads[f'layer{i}'].reshape(-1)) for i in range(num_layers)]
    token, new = memory_spaces.to_host(jnp.zeros((1,), jnp.float32)), {}
    runtime = x[0, 0].astype(jnp.float32)  # a device value XLA cannot fold
    for chunk in np.array_split(np.arange(num_layers)[::-1], chunks):
      def update(token, old, *g):
        # Every output reads the token and the next token reads every output: XLA
        # regroups host instructions one by one, so work that does not depend on the
        # link would join another call.
        out = tuple(r + gi.astype(jnp.float32) + token[0] for r, gi in zip(old, g))
        return sum(o[:1] for o in out) * 0 + token, out
      # With a device link the token is returned in device memory, where a device op
      # makes the next region's input from it.
      token_space = memory_spaces.DEVICE if link is Link.DEVICE else memory_spaces.HOST
      last, out = memory_spaces.host_region(
          update, out_spaces=(token_space, memory_spaces.HOST))(
          token, tuple(rows[int(i)] for i in chunk), *[on_host[int(i)] for i in chunk])
      if link is Link.HOST:
        token = last
      elif link is Link.DEVICE:
        token = memory_spaces.to_host(last * runtime)
      new.update({int(i): r for i, r in zip(chunk, out)})
    return jnp.stack([new[i] for i in range(num_layers)])

  return step, (params, rows, x), {}


def mlp_step(num_layers: int, width: int, *, dtype: str = 'bfloat16', policy: Any = None,
             clip: float | None = 1.0, batch: int = 64,
             early: tuple[int, ...] | None = None) -> tuple[Callable[..., Any], tuple, dict]:
  """A donated train step of an L x W MLP with `dos_jax.adamw` (one subgroup per layer,
  `Stride(2)` by default, clipped), built as the two-memory program with nothing but
  the policy set; `early`: other early host calls than the state's own
  (`dos_jax.migrate(..., early=early)`; `()`: one host call)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  import dos_jax  # pylint: disable=import-outside-toplevel

  # Committed, as a training loop's params are (an uncommitted init warns).
  params = jax.device_put(mlp_params(num_layers, width, jnp.dtype(dtype)), jax.devices()[0])
  x = jnp.asarray(np.random.default_rng(1).standard_normal((batch, width)), jnp.dtype(dtype))
  offload = dos_jax.Offload(
      subgroup_size=width * width + width,
      policy=dos_jax.Stride(2) if policy is None else policy)
  adamw = dos_jax.adamw(1e-3, offload=offload,
                        implementation=dos_jax.Implementation(program='gpu'))
  opt = adamw if clip is None else dos_jax.chain(dos_jax.clip_by_global_norm(clip), adamw)
  state = opt.init(params)
  if early is not None:
    is_state = lambda x: isinstance(x, dos_jax.OffloadedState)
    found = [x for x in jax.tree.leaves(state, is_leaf=is_state) if is_state(x)]
    state = dos_jax.migrate(state, found[0].partition.plan, early=tuple(early))

  def step(p, s, x):
    loss, g = jax.value_and_grad(mlp_loss)(p, x)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  return step, (params, state, x), {'donate_argnums': (0, 1)}
