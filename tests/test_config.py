"""Run configs: every shipped file loads; bad keys and values are named; overrides work."""

import dataclasses
import glob
import os
import random

import pytest

import dos_jax
from dos_jax.train import config
from dos_jax.train import step as step_lib
from dos_jax.train.configlib import ConfigError, from_dict, parse_override, to_dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(glob.glob(os.path.join(REPO, 'configs', '*.yaml'))
                      + glob.glob(os.path.join(REPO, 'configs', 'paper', '*.yaml')))


def test_the_expected_configs_ship():
  names = {os.path.basename(p)[:-5] for p in CONFIG_FILES}
  assert {'tiny', '125m', '1.3b', '7b', '13b', '20b'} <= names


@pytest.mark.parametrize('path', CONFIG_FILES, ids=os.path.basename)
def test_every_config_file_loads_and_round_trips(path):
  cfg = config.load(path)
  assert isinstance(cfg, config.RunConfig)
  assert from_dict(config.RunConfig, to_dict(cfg)) == cfg
  # Named by their preset, with a suffix for a variant ('7b-1gpu').
  assert cfg.model.preset == os.path.basename(path)[:-5].split('-')[0]


def test_packaged_default_is_configs_tiny():
  with open(os.path.join(REPO, 'configs', 'tiny.yaml'), encoding='utf-8') as f:
    assert f.read() == config.default_config_text()
  assert config.load() == config.load(os.path.join(REPO, 'configs', 'tiny.yaml'))


def test_empty_file_gives_the_dataclass_defaults(tmp_path):
  path = tmp_path / 'empty.yaml'
  path.write_text('')
  assert config.load(str(path)) == config.RunConfig()


def _error(path, overrides=()):
  with pytest.raises(ConfigError) as info:
    config.load(path, overrides)
  message = str(info.value)
  assert '\n' not in message
  return message


@pytest.mark.parametrize(
    'override, expected',
    [
        ('optim.lr=abc', "optim.lr: expected a positive float, got 'abc'"),
        ('optim.lr=-0.1', 'optim.lr: expected a positive float, got -0.1'),
        ('optim.b2=1.0', 'optim.b2: expected a float in [0, 1), got 1.0'),
        ('optim.schedule=linear', "optim.schedule: expected one of 'cosine', 'constant'"),
        ('optim.mu_dtype=float16', 'optim.mu_dtype: expected one of'),
        ('train.steps=2.5', 'train.steps: expected a positive integer, got 2.5'),
        ('train.steps=true', 'train.steps: expected a positive integer, got True'),
        ('checkpoint.async_save=1', 'checkpoint.async_save: expected true or false, got 1'),
        ('offload.policy=gpu', "offload.policy: expected one of 'all_host'"),
        ('offload.fraction=1.5', 'offload.fraction: expected a float in [0, 1], got 1.5'),
        ('offload.subgroup_size=0', 'offload.subgroup_size: expected a positive integer'),
        ('offload.storage=stacked', 'offload.storage: unknown key'),
        ('train.microbatches=4', 'train.microbatches: 4 needs mesh.pipeline > 1'),
        ('mesh.data=0', 'mesh.data: expected a positive integer or -1'),
        ('data.seq_len=4096', 'data.seq_len: 4096 exceeds model.max_seq_len (256)'),
        ('mesh.data=3', 'data.batch_size: 32 is not divisible by mesh.data (3)'),
        ('optim.betas=1', 'optim.betas: unknown key'),
        ('nonsense.key=1', 'nonsense: unknown key'),
        ('optim=3', 'optim: expected a mapping'),
        ('model.n_kv_heads=3', 'model.n_kv_heads: 3 must divide n_heads (4)'),
        ('model.rope_scaling.rope_type=yarn',
         "model.rope_scaling.rope_type: expected one of 'llama3', got 'yarn'"),
        ('model.rope_scaling.factorr=2', 'model.rope_scaling.factorr: unknown key'),
        ('model.rope_scaling.high_freq_factor=0.5',
         'model.rope_scaling.high_freq_factor: 0.5 must exceed low_freq_factor (1.0)'),
        ('model.norm_eps=0', 'model.norm_eps: must be a positive number, got 0'),
        ('model.from_hf=/nonexistent', 'model.from_hf: /nonexistent: no such folder'),
    ],
)
def test_bad_values_name_the_key_and_the_file(override, expected):
  path = os.path.join(REPO, 'configs', 'tiny.yaml')
  message = _error(path, [override])
  assert message.startswith(f'--set {override}: ')  # The culprit is the override.
  assert expected in message


def test_pipelined_run_refuses_tied_embeddings():
  message = _error(None, ['mesh.pipeline=2', 'model.tie_embeddings=true'])
  assert 'model.tie_embeddings: a pipelined run (mesh.pipeline > 1) needs an untied' in message


def test_unknown_key_in_a_file_names_its_path(tmp_path):
  path = tmp_path / 'bad.yaml'
  path.write_text('optim:\n  lr: 1.0e-3\n  wamrup_steps: 10\n')
  message = _error(str(path))
  assert message.startswith(f'{path}: optim.wamrup_steps: unknown key')
  assert 'warmup_steps' in message  # The known keys are listed.


def test_missing_and_malformed_files(tmp_path):
  assert _error(str(tmp_path / 'nope.yaml')) == f'{tmp_path / "nope.yaml"}: no such config file'
  bad = tmp_path / 'bad.yaml'
  bad.write_text('optim: [1, 2\n')
  assert _error(str(bad)).startswith(f'{bad}: not valid YAML')
  scalar = tmp_path / 'scalar.yaml'
  scalar.write_text('3\n')
  assert 'expected a mapping' in _error(str(scalar))


def test_overrides_are_yaml_values_and_create_sections(tmp_path, seed):
  path = tmp_path / 'empty.yaml'
  path.write_text('')
  lr = random.Random(seed).uniform(1e-5, 1e-2)
  cfg = config.load(str(path), [
      f'optim.lr={lr!r}', 'optim.clip_norm=null', 'offload.policy=stride',
      'offload.stride=3', 'train.steps=1e3', 'optim.lr=5e-4',
  ])
  assert cfg.optim.lr == 5e-4  # The last override of a key wins.
  assert cfg.optim.clip_norm is None
  assert cfg.train.steps == 1000  # YAML 1.1 reads 1e3 as a string; numbers still parse.
  assert cfg.offload.placement == dos_jax.Stride(3)
  assert parse_override('a.b=[1, 2]') == (('a', 'b'), [1, 2])
  for bad in ('optim.lr', '=3', 'optim..lr=3'):
    with pytest.raises(ConfigError, match='expected KEY=VALUE'):
      parse_override(bad)
  message = _error(os.path.join(REPO, 'configs', 'tiny.yaml'), ['optim.lr.x=1'])
  assert 'optim.lr is not a section' in message


def test_policy_names_parse_once_into_policy_values():
  cases = {
      'all_host': dos_jax.AllHost(),
      'all_device': dos_jax.AllDevice(),
      'stride': dos_jax.Stride(4),
      'device_fraction': dos_jax.DeviceFraction(0.25),
  }
  for name, expected in cases.items():
    offload = from_dict(
        config.OffloadConfig, {'policy': name, 'stride': 4, 'fraction': 0.25}
    )
    assert offload.placement == expected
  assert isinstance(from_dict(config.OffloadConfig, {'policy': 'auto'}).placement, dos_jax.Auto)
  # The platform key reaches the Implementation; unset, the backend decides at init.
  implementation = step_lib.make_implementation(
      from_dict(config.OffloadConfig, {'platform': 'gpu'}))
  assert implementation.program is dos_jax.Program.TWO_MEMORIES
  assert step_lib.make_implementation(from_dict(config.OffloadConfig, {})).program is None
  # A program the caller names wins over the key.
  assert step_lib.make_implementation(
      from_dict(config.OffloadConfig, {'platform': 'cpu'}),
      dos_jax.Program.TWO_MEMORIES).program is dos_jax.Program.TWO_MEMORIES
  # What chose among constructions is no config key (issue 40): the library decides.
  for key, value in (('storage', 'per_subgroup'), ('early_chunks', 2), ('chunks', 2),
                     ('stream_lanes', 1), ('shard_major', True)):
    with pytest.raises(ConfigError, match=f'offload.{key}: unknown key'):
      from_dict(config.OffloadConfig, {key: value}, key='offload')


def test_configs_are_frozen():
  cfg = config.RunConfig()
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.optim.lr = 1.0  # type: ignore[misc]
