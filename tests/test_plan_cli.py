"""`dos-jax plan` through the real CLI entry point: output and exit codes."""

import re

import pytest

from dos_jax import cli
from dos_jax.planner import costmodel


def run(capsys, *argv):
  code = cli.main(['plan', *argv])
  out = capsys.readouterr()
  return code, out.out, out.err


@pytest.mark.parametrize('model', ['7b', '13b', '20b'])
def test_fits_on_h100_node(capsys, model):
  # The paper's settings by default: 2048 tokens, micro-batch 1, flash attention.
  code, out, _ = run(capsys, '--model', model)
  assert code == 0
  for needed in ('device (each)', 'pinned host (node)', 'chosen plan', 'AllHost', 'Stride(2)',
                 'DeviceFraction(0.5)', 'iteration'):
    assert needed in out, needed
  rows = dict(re.findall(r'^  (Auto \(chosen\)|AllHost|Stride\(2\))\s+([\d,.]+) ms', out, re.M))
  chosen, all_host, stride2 = (float(rows[k].replace(',', '')) for k in ('Auto (chosen)', 'AllHost', 'Stride(2)'))
  assert chosen <= stride2 <= all_host


def test_70b_does_not_fit_and_says_by_how_much(capsys):
  code, out, _ = run(capsys, '--model', '70b', '--no-remat')
  assert code == 1
  assert re.search(r'device memory short by [\d,.]+ GiB per device', out)
  # Unasked, the plan recomputes each block where the activations would not fit.
  code, out, _ = run(capsys, '--model', '70b')
  assert code == 0 and 'planned with --remat' in out, out


def test_host_memory_shortfall(capsys):
  code, out, _ = run(capsys, '--model', '13b', '--host-memory', '64GiB')
  assert code == 1
  assert re.search(r'pinned host memory short by [\d,.]+ GiB per node', out)


def test_overrides_change_the_answer(capsys):
  code, out, _ = run(capsys, '--model', '20b', '--gpus-per-node', '1', '--device-memory', '40GB')
  assert code == 1 and 'device memory short' in out
  code, out, _ = run(capsys, '--model', '1.3b', '--profile', 'a100-pcie4', '--param-dtype', 'fp32',
                     '--subgroup-size', '1e7', '--gpus-per-node', '1')
  assert code == 0 and '(8 B/param)' in out and 'subgroups of 10,000,000 elements' in out


def test_profile_from_json(capsys, tmp_path):
  path = tmp_path / 'node.json'
  costmodel.A100_PCIE_GEN4_NODE.to_json(path)
  code, out, _ = run(capsys, '--model', '7b', '--profile', str(path), '--gpus-per-node', '4',
                     '--seq-len', '1024')
  assert code == 0 and 'profile: a100-pcie4' in out
  assert 'iteration' in out  # the table header stays; no TFLOP/s default for a file


@pytest.mark.parametrize('argv, culprit', [
    (['--model', '9b'], '--model'),
    (['--model', '7b', '--device-memory', '12XB'], '--device-memory'),
    (['--model', '7b', '--subgroup-size', '0'], '--subgroup-size'),
    (['--model', '7b', '--param-dtype', 'fp8'], '--param-dtype'),
    (['--model', '7b', '--config', 'x.yaml'], '--config'),
    ([], '--model'),
])
def test_bad_arguments_exit_2_naming_the_culprit(capsys, argv, culprit):
  with pytest.raises(SystemExit) as e:
    cli.main(['plan', *argv])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert culprit in err.splitlines()[-1]


@pytest.mark.parametrize('profile, culprit', [('nope', "unknown profile 'nope'"), ('missing.json', 'not found')])
def test_bad_profile_exits_2(capsys, profile, culprit):
  code, _, err = run(capsys, '--model', '7b', '--profile', profile)
  assert code == 2
  assert err.count('\n') == 1 and culprit in err


def test_config_without_runner_or_file_exits_2(capsys, tmp_path):
  code, _, err = run(capsys, '--config', str(tmp_path / 'absent.yaml'))
  assert code == 2 and err.startswith('dos-jax plan: error:') and err.count('\n') == 1


def test_plan_from_a_run_config(capsys):
  config = __import__('pathlib').Path(__file__).parents[1] / 'configs' / '7b.yaml'
  code, out, _ = run(capsys, '--config', str(config), '--profile', 'h100-pcie5')
  assert code == 0 and 'chosen plan' in out


def test_the_papers_runs_fit_with_no_flags_and_not_with_xla_attention(capsys):
  """Issue 29's reference: XLA's attention keeps float32 scores, s^2 per head and layer,
  with which 20b on the H100 node and 13b on the A100 node are short of device memory;
  cuDNN's flash attention (the default on GPU profiles) keeps none, and both fit."""
  for argv in (['--model', '20b', '--profile', 'h100-pcie5'],
               ['--model', '13b', '--profile', 'a100-pcie4']):
    code, out, _ = run(capsys, *argv)
    assert code == 0 and 'cudnn attention, no remat' in out, out
    assert 'sequences of 2048 tokens, micro-batch 1' in out
    code, out, _ = run(capsys, *argv, '--attention', 'xla', '--no-remat')
    assert code == 1 and 'device memory short' in out, out
    # Recomputing each block keeps one layer's scores at a time: then XLA's fits too.
    code, out, _ = run(capsys, *argv, '--attention', 'xla', '--remat')
    assert code == 0, out


def test_remat_shrinks_the_activations(capsys):
  acts = {}
  for flag in ('--no-remat', '--remat'):
    _, out, _ = run(capsys, '--model', '7b', flag)
    acts[flag] = float(re.search(r'activations ~([\d.]+) GiB', out).group(1))
  assert acts['--remat'] < acts['--no-remat'] / 4


@pytest.mark.parametrize('name, devices', [
    ('paper/7b.yaml', 4), ('paper/13b.yaml', 4), ('paper/20b.yaml', 4), ('7b-1gpu.yaml', 1)])
def test_the_papers_configs_fit_the_h100_profile(capsys, name, devices):
  """The configs' own settings (fsdp x data devices, micro-batch, attention, remat) are
  what is planned, and they fit."""
  config = __import__('pathlib').Path(__file__).parents[1] / 'configs' / name
  code, out, _ = run(capsys, '--config', str(config), '--profile', 'h100-pcie5')
  assert code == 0, out
  assert 'sequences of 2048 tokens, micro-batch 1, cudnn attention, no remat' in out
  assert f'{devices} device(s) per node' in out
