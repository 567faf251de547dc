"""`dos-jax train --set model.from_hf=DIR` and `dos-jax export-hf`, against transformers.

A tiny random LlamaForCausalLM (GQA, llama3 rope scaling; tests/test_hf.py's
`make_reference`, seed 11) trains for two steps on a dataset prepared with a word-level
tokenizer.json. The run's first loss must equal transformers' loss on the run's first
batch to 2e-5 (float32: both means of the same 256 cross-entropies, whose logits agree
to ~1e-5). The export of the run's checkpoint must load in `from_pretrained` with the
checkpoint's tensors exactly, and carry the tokenizer.json. Mistakes are one line, exit
2, and write nothing.
"""

import json
import os
import shutil

import numpy as np
import pytest

from dos_jax import cli
from dos_jax.train import config, data, hf, hf_export, trainer
from dos_jax.train.progress import read_metrics
from tests import hf_imports

pytestmark = pytest.mark.hf
torch, transformers = hf_imports.import_transformers()
tokenizers = pytest.importorskip('tokenizers', reason='the hf tests need tokenizers')

from tests.test_hf import make_reference  # pylint: disable=wrong-import-position

WORDS = ('the a of to in is was for on that with as by at it from his an were are which'
         ' this be or has had not but first one their its new after who they have her she'
         ' two been other when there all during into school time may years more most only'
         ' over city some world would where later up such used many can state about').split()
RUN = ['data.seq_len=32', 'data.batch_size=8', 'optim.warmup_steps=1', 'train.steps=2',
       'train.eval_batches=1', 'train.log_every=1', 'checkpoint.every=1',
       'checkpoint.async_save=false', 'model.param_dtype=float32',
       'model.compute_dtype=float32', 'offload.policy=all_host']


def _sets(*items):
  args = []
  for item in items:
    args += ['--set', item]
  return args


def _one_error_line(capsys) -> str:
  err = capsys.readouterr().err
  lines = err.strip().splitlines()
  assert len(lines) == 1, err
  assert lines[0].startswith('dos-jax: error: ') and 'Traceback' not in err
  return lines[0]


@pytest.fixture(scope='module')
def word_dataset(tmp_path_factory, module_seed):
  """A dataset prepared with a word-level tokenizer.json (`module_seed` draws the text)."""
  root = tmp_path_factory.mktemp('words')
  vocab = {w: i for i, w in enumerate(['[UNK]', *WORDS])}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token='[UNK]'))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(root / 'tokenizer.json'))
  (root / 'tokenizer_config.json').write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
  rng = np.random.default_rng(module_seed)
  (root / 'text.txt').write_text(' '.join(rng.choice(WORDS, 6000)))
  assert cli.main(['prepare', str(root / 'text.txt'), '--out', str(root / 'data'),
                   '--tokenizer', str(root / 'tokenizer.json'), '--val-fraction', '0.1']) == 0
  return root


def test_train_from_hf_matches_reference_then_exports_and_resumes(tmp_path, word_dataset,
                                                                  capsys):
  ref = make_reference(tmp_path / 'llama', seed=11, kv_heads=2, scaling=True, vocab=128)
  out = tmp_path / 'run'
  sets = [*RUN, f'model.from_hf={tmp_path / "llama"}', f'data.path={word_dataset / "data"}',
          f'train.out_dir={out}']
  assert cli.main(['train', *_sets(*sets)]) == 0
  first = next(r for r in read_metrics(str(out / 'metrics.jsonl')) if r.get('step') == 1)

  cfg = config.load(None, sets)
  batch = next(data.sampler_for(cfg.data, trainer.dataset_dir_for(cfg.data), 'train'))
  batch = torch.tensor(np.asarray(batch, np.int64))
  with torch.no_grad():
    logits = ref(batch[:, :-1]).logits.float()
  want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           batch[:, 1:].reshape(-1)).item()
  assert first['loss'] == pytest.approx(want, abs=2e-5)

  # Export step 2 (trained past the reference): transformers loads exactly its tensors.
  assert cli.main(['export-hf', str(out), '--out', str(tmp_path / 'export'),
                   '--step', '2']) == 0
  assert {'config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json'} <= set(
      os.listdir(tmp_path / 'export'))
  assert (tmp_path / 'export' / 'tokenizer.json').read_bytes() == (
      word_dataset / 'tokenizer.json').read_bytes()
  trained = hf_export.restore_params(cfg.model, str(out / 'checkpoints'), 2)
  back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / 'export')).state_dict()
  for t in hf.tensors(cfg.model):
    leaf = trained
    for key in t.path:
      leaf = leaf[key]
    np.testing.assert_array_equal(back[t.name].numpy(), t.to_hf(np.asarray(leaf)), t.name)
  assert not np.array_equal(back['model.norm.weight'].numpy(),
                            ref.state_dict()['model.norm.weight'].numpy())

  # A resumed run takes its checkpoint: the weights in PATH are no longer read.
  os.remove(tmp_path / 'llama' / hf.SINGLE_FILE)
  capsys.readouterr()
  assert cli.main(['train', *_sets(*sets, 'train.steps=3')]) == 0
  assert 'resumed from' in capsys.readouterr().err


@pytest.mark.parametrize('change, culprit', [
    ('size', 'model.n_heads: 2 disagrees with 4 in'),
    ('vocab', 'vocab_size in'),
    ('tensor', "tensor 'model.layers.1.self_attn.k_proj.weight' is missing"),
    ('arch', "architecture ['GPT2LMHeadModel'] is not supported"),
])
def test_from_hf_mistakes_are_one_line_exit_2_and_write_nothing(tmp_path, word_dataset,
                                                                 capsys, change, culprit):
  folder = tmp_path / 'llama'
  make_reference(folder, seed=12, vocab=20 if change == 'vocab' else 128)
  sets = [*RUN, f'model.from_hf={folder}', f'data.path={word_dataset / "data"}',
          f'train.out_dir={tmp_path / "run"}']
  if change == 'size':
    sets.append('model.n_heads=2')
  elif change == 'tensor':
    from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel
    tensors = load_file(str(folder / hf.SINGLE_FILE))
    del tensors['model.layers.1.self_attn.k_proj.weight']
    save_file(tensors, str(folder / hf.SINGLE_FILE), metadata={'format': 'pt'})
  elif change == 'arch':
    raw = json.loads((folder / 'config.json').read_text())
    raw['architectures'] = ['GPT2LMHeadModel']
    (folder / 'config.json').write_text(json.dumps(raw))
  capsys.readouterr()
  assert cli.main(['train', *_sets(*sets)]) == 2
  line = _one_error_line(capsys)
  assert culprit in line and 'model.' in line
  assert not (tmp_path / 'run').exists()


def test_export_mistakes_are_one_line_exit_2_and_write_nothing(tmp_path, capsys):
  assert cli.main(['export-hf', str(tmp_path / 'nope'), '--out', str(tmp_path / 'x')]) == 2
  assert 'not a run directory' in _one_error_line(capsys)
  run = tmp_path / 'run'
  run.mkdir()
  shutil.copy(config.__file__.replace('config.py', 'configs/tiny.yaml'), run / 'config.yaml')
  assert cli.main(['export-hf', str(run), '--out', str(tmp_path / 'x')]) == 2
  assert 'no complete checkpoint' in _one_error_line(capsys)
  (tmp_path / 'taken').mkdir()
  (tmp_path / 'taken' / 'f').write_text('')
  assert cli.main(['export-hf', str(run), '--out', str(tmp_path / 'taken')]) == 2
  assert 'exists' in _one_error_line(capsys)
  assert sorted(os.listdir(tmp_path)) == ['run', 'taken']
