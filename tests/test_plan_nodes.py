"""`dos-jax plan` and the runner's `Auto` rank plans alike, and `--nodes` plans a
multi-node run: the data-parallel collectives over the inter-node link, and host memory
per node."""

import re

import pytest

import dos_jax
from dos_jax import cli
from dos_jax import model_shapes
from dos_jax.planner import auto
from dos_jax.planner import costmodel
from dos_jax.planner import hardware


def _plan(capsys, *argv) -> str:
  assert cli.main(['plan', *argv]) == 0
  return capsys.readouterr().out


@pytest.mark.parametrize('model', ['7b', '13b', '20b'])
def test_plan_prints_the_plan_the_runners_auto_chooses_from_the_same_inputs(
    capsys, monkeypatch, model):
  made = []

  class Recorded(auto.Auto):

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      made.append((args, kwargs, self))

  monkeypatch.setattr(auto, 'Auto', Recorded)
  out = _plan(capsys, '--model', model, '--profile', 'h100-pcie5')
  (args, kwargs, chooser), = made
  profile, = args
  assert profile is hardware.H100_PCIE_GEN5_NODE
  printed = re.search(r'^chosen plan: (.*) \(\d+% resident', out, re.M).group(1)
  assert printed == chooser.current.describe()
  # The runner's class, given the same inputs, chooses that plan...
  shape = model_shapes.preset(model)
  assert kwargs['last_grad_bytes'] == auto.last_grad_bytes(shape.vocab_size, shape.dim, 2, 4)
  assert kwargs['last_grad_bytes'] > 0 and kwargs['backward_seconds'] > 0
  assert dos_jax.Auto(profile, **kwargs).plan(chooser.spec) == chooser.current
  # ... and ranks every candidate as `rank` does with those inputs, the last gradient's
  # exposed copy included.
  ranking = auto.rank(profile, chooser.spec, kwargs['budget_bytes'],
                      backward_seconds=kwargs['backward_seconds'],
                      activation_bytes=kwargs['activation_bytes'],
                      last_grad_bytes=kwargs['last_grad_bytes'])
  assert [c.plan for c in ranking] == [c.plan for c in chooser.ranking]
  assert [c.prediction for c in ranking] == [c.prediction for c in chooser.ranking]


def test_internode_collectives_follow_the_ring():
  profile = hardware.H100_PCIE_GEN5_NODE
  assert costmodel.internode(profile, 1, grad_bytes=8e9, param_bytes=8e9).seconds == 0
  link = costmodel.internode(profile, 4, grad_bytes=8e9, param_bytes=4e9)
  assert link.link_bytes == pytest.approx(0.75 * 12e9)
  assert link.reduce_scatter_seconds == pytest.approx(0.75 * 8e9 / 50e9)
  assert link.all_gather_seconds == pytest.approx(0.75 * 4e9 / 50e9)
  assert hardware.HardwareProfile.from_dict(
      {k: v for k, v in profile.to_dict().items() if k != 'internode_gbps'}
  ).internode_gbps == 25.0  # a profile without the field: 200 Gb/s InfiniBand
  with pytest.raises(ValueError, match='internode_gbps'):
    hardware.HardwareProfile.from_dict({**profile.to_dict(), 'internode_gbps': 0})


def _ms(text: str) -> float:
  value, unit = re.fullmatch(r'([\d,.]+) (ms|s)', text).groups()
  return float(value.replace(',', '')) * (1e-3 if unit == 'ms' else 1)


def test_plan_across_nodes_counts_the_link_and_host_memory_per_node(capsys):
  one = _plan(capsys, '--model', '13b', '--gpus-per-node', '8')
  assert 'across' not in one
  out = _plan(capsys, '--model', '13b', '--nodes', '2', '--gpus-per-node', '4')
  assert '4 device(s) per node x 2 nodes' in out and 'sharded over the 8 device(s)' in out
  params = model_shapes.preset('13b').num_params()
  # Sharded over the same 8 devices, per device the two runs are one (same chosen plan).
  assert one.split('\nchosen plan:')[1].split('\n')[0] == out.split('\nchosen plan:')[1].split('\n')[0]
  m = re.search(r'gradient reduce-scatter (.+?) \+ new params all-gather (.+?) \(([\d.]+) GiB',
                out)
  half = 0.5 * params * 2  # (N-1)/N of the bf16 tensor through each node's link
  assert _ms(m.group(1)) == pytest.approx(half / 50e9, rel=5e-3)
  assert _ms(m.group(2)) == pytest.approx(half / 50e9, rel=5e-3)
  assert float(m.group(3)) == pytest.approx(2 * half / 2**30, abs=0.05)
  step = re.search(r'iteration ([\d,.]+ m?s) \+ collectives ([\d,.]+ m?s) = ([\d,.]+ m?s)', out)
  iteration, link, total = (_ms(step.group(i)) for i in (1, 2, 3))
  assert total == pytest.approx(iteration + link, abs=2e-3)
  # The iteration is the chosen plan's row of the table.
  assert re.search(r'Auto \(chosen\) +[\d,.]+ m?s +' + re.escape(step.group(1)), out)
  # Host memory per node: 12 B of state per param, half the model's on each node.
  state = re.search(r'host memory per node: optimizer state ([\d,.]+) GiB', out).group(1)
  assert float(state.replace(',', '')) == pytest.approx(12 * params / 2 / 2**30, abs=0.06)
  slower = _plan(capsys, '--model', '13b', '--nodes', '2', '--gpus-per-node', '4',
                 '--internode-gbps', '25')
  m25 = re.search(r'gradient reduce-scatter (.+?) \+', slower)
  assert _ms(m25.group(1)) == pytest.approx(2 * _ms(m.group(1)), rel=1e-2)
