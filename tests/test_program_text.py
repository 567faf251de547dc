"""`update` is pure: the program depends only on the step's inputs and static arguments.

The two-memory program's step, lowered for `cuda`, gives one StableHLO text: traced twice
in one process, traced after the policy object changed its mind (`Auto` re-planned,
measured another clip rate), and traced in a fresh process. Its plan and host calls come
from the state (`Partition`), its scheduling groups are numbered per trace.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap


_BUILD = textwrap.dedent('''
    import hashlib, jax, jax.numpy as jnp, optax, dos_jax
    from tests.tooling import probes
    from dos_jax.planner import costmodel

    def build(layers=6, width=64):
      params = jax.device_put(probes.mlp_params(layers, width, jnp.bfloat16), jax.devices()[0])
      x = jnp.ones((8, width), jnp.bfloat16)
      auto = dos_jax.Auto(profile=costmodel.PROFILE_PRESETS['h100-pcie5'])
      # XLA's device update: Pallas needs an abstract GPU device to lower on jax 0.11+.
      offload = dos_jax.Offload(subgroup_size=width * width + width, policy=auto)
      implementation = dos_jax.Implementation(program='gpu', device=dos_jax.UpdateImpl.XLA)
      opt = dos_jax.chain(dos_jax.clip_by_global_norm(1.0),
                          dos_jax.adamw(1e-3, offload=offload, implementation=implementation))
      state = opt.init(params)

      def step(p, s, x):
        loss, g = jax.value_and_grad(probes.mlp_loss)(p, x)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

      def text():
        return jax.jit(step, donate_argnums=(0, 1)).trace(params, state, x).lower(
            lowering_platforms=('cuda',)).as_text()
      return auto, text
''')

namespace: dict = {}
exec(compile(_BUILD, '<build>', 'exec'), namespace)  # pylint: disable=exec-used


def _digest(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()


def test_two_traces_and_a_changed_policy_give_one_program():
  auto, text = namespace['build']()
  first = text()
  assert '_scheduling_group_id' in first  # the grouped construction: numbered group ids
  assert text() == first, 'a second trace in the same process changed the program'
  # The policy object learns and re-plans between steps; the state keeps the plan the
  # step runs until the runner moves it (`dos_jax.migrate`).
  auto.observe_rollbacks(40, 100)
  auto.backward_seconds = 0.5
  assert text() == first, 'the step read the policy object while tracing'


def test_a_fresh_process_gives_the_same_program():
  _, text = namespace['build']()
  here = _digest(text())
  script = _BUILD + '\nprint(hashlib.sha256(build()[1]().encode()).hexdigest())\n'
  done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                        timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip().splitlines()[-1] == here
