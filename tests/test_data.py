"""Token datasets: prepare on real files, meta.json, atomic writes, the default corpus,
deterministic and resumable sampling, clear errors."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from dos_jax.train import data
from dos_jax.train import tokenizer as tokenizer_lib


def _random_text(rng, n):
  words = ['alpha', 'beta', 'gamma', 'delta', 'pi', 'δ', '字', '\n', ' ', '\t', '{', '}']
  return ''.join(rng.choice(words) for _ in range(n)).encode()


@pytest.fixture
def corpus(tmp_path, seed):
  """A directory tree of small text files plus what `prepare` should read from it, in order."""
  rng = np.random.default_rng(seed)
  root = tmp_path / 'src'
  (root / 'b_dir' / 'deeper').mkdir(parents=True)
  (root / 'a_dir').mkdir()
  (root / '__pycache__').mkdir()
  (root / '.hidden_dir').mkdir()
  files = {
      'z_top.txt': _random_text(rng, 300),
      'a_dir/one.py': _random_text(rng, 200),
      'b_dir/deeper/two.md': _random_text(rng, 250),
      'b_dir/three.txt': _random_text(rng, 100),
  }
  for name, content in files.items():
    (root / name).write_bytes(content)
  (root / '.hidden.txt').write_bytes(b'hidden')
  (root / '__pycache__' / 'x.pyc').write_bytes(b'cache')
  (root / '.hidden_dir' / 'y.txt').write_bytes(b'hidden')
  (root / 'a_dir' / 'blob.bin').write_bytes(b'\x00\x01binary')
  # Directory walk: files of a directory (sorted) before its subdirectories (sorted).
  order = ['z_top.txt', 'a_dir/one.py', 'b_dir/three.txt', 'b_dir/deeper/two.md']
  return root, b''.join(files[name] for name in order)


def _read(path, dtype='uint16'):
  return np.fromfile(path, dtype=dtype)


def test_prepare_writes_the_bytes_and_meta(corpus, tmp_path):
  root, expected = corpus
  extra = tmp_path / 'extra.txt'
  extra.write_bytes(b'explicit file \x00 is taken as given\n')
  out = tmp_path / 'ds'
  meta = data.prepare([root, extra], out, val_fraction=0.1, min_val_tokens=0, progress=False)

  stream = np.frombuffer(expected + extra.read_bytes(), np.uint8)
  train, val = _read(out / 'train.bin'), _read(out / 'val.bin')
  num_val = int(np.ceil(0.1 * len(stream)))
  assert len(val) == num_val and len(train) == len(stream) - num_val
  np.testing.assert_array_equal(np.concatenate([train, val]), stream)
  assert sorted(os.listdir(out)) == ['meta.json', 'train.bin', 'val.bin']

  on_disk = json.loads((out / 'meta.json').read_text())
  assert on_disk == json.loads(meta.to_json())
  assert meta == data.load_meta(out)
  assert (meta.vocab_size, meta.dtype, meta.tokenizer) == (256, 'uint16', 'bytes')
  assert (meta.train_tokens, meta.val_tokens) == (len(train), len(val))
  assert meta.num_files == 5 and meta.skipped_files == 1
  assert meta.input_bytes == len(stream)
  assert meta.sources == (str(root), str(extra))


def test_output_inside_the_input_is_not_read_back(corpus):
  root, expected = corpus
  data.prepare([root], root / 'ds', val_fraction=0.0, progress=False)
  meta = data.prepare([root], root / 'ds', val_fraction=0.0, progress=False)
  assert meta.input_bytes == len(expected) and meta.skipped_files == 1


def test_max_bytes_cuts_the_stream(corpus, tmp_path):
  root, expected = corpus
  cap = (root / 'z_top.txt').stat().st_size + 10  # Ends 10 bytes into the second file.
  meta = data.prepare([root], tmp_path / 'ds', val_fraction=0.0, max_bytes=cap, progress=False)
  np.testing.assert_array_equal(_read(tmp_path / 'ds' / 'train.bin'),
                                np.frombuffer(expected[:cap], np.uint8))
  assert meta.input_bytes == cap and meta.num_files == 2 and meta.val_tokens == 0


def test_failure_midway_leaves_no_partial_files(corpus, tmp_path):
  root, _ = corpus
  out = tmp_path / 'ds'
  # A good dataset is there first; the failed prepare must leave it as it was.
  data.prepare([root], out, progress=False)
  before = {name: (out / name).read_bytes() for name in os.listdir(out)}
  unreadable = Path('/proc/self/mem')  # Opens, then fails with EIO on the first read.
  if not unreadable.exists():
    pytest.skip('needs Linux /proc')
  with pytest.raises(OSError):
    data.prepare([root, unreadable], out, progress=False)
  assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before

  fresh = tmp_path / 'fresh'
  with pytest.raises(OSError):
    data.prepare([root, unreadable], fresh, progress=False)
  assert not fresh.exists()  # A directory it created is removed again.


def test_default_corpus_is_the_stdlib_sources(tmp_path, capsys):
  meta = data.prepare(None, tmp_path / 'ds', max_bytes=300_000)
  assert meta.input_bytes == 300_000 and meta.sources == (f'python-stdlib:{data.stdlib_dir()}',)
  tokens = np.concatenate([_read(tmp_path / 'ds' / 'train.bin'), _read(tmp_path / 'ds' / 'val.bin')])
  text = tokens.astype(np.uint8).tobytes()
  # Real Python source: the first file read is the stdlib's own __future__.py.
  first = sorted(p for p in data.stdlib_dir().iterdir() if p.suffix == '.py')[0]
  assert text.startswith(first.read_bytes()[:1000])
  assert text.count(b'def ') > 100
  assert 'wrote' in capsys.readouterr().err


def test_resolve_dataset_prepares_the_default_once(tmp_path, monkeypatch):
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
  cfg = data.DataConfig(val_fraction=0.02)
  root = data.resolve_dataset(cfg, progress=False)
  assert root == tmp_path / 'dos_jax' / 'data' / 'stdlib-bytes'
  meta = data.load_meta(root)
  assert meta.max_bytes == data.DEFAULT_CORPUS_BYTES and meta.val_fraction == 0.02
  stamp = (root / 'train.bin').stat().st_mtime_ns
  assert data.resolve_dataset(cfg, progress=False) == root
  assert (root / 'train.bin').stat().st_mtime_ns == stamp  # Reused, not prepared again.
  assert data.resolve_dataset(data.DataConfig(path=str(root))) == root


def _dataset(tmp_path, seed, val_fraction=0.1):
  rng = np.random.default_rng(seed)
  src = tmp_path / 'src.txt'
  src.write_bytes(_random_text(rng, 2000))
  data.prepare([src], tmp_path / 'ds', val_fraction=val_fraction, min_val_tokens=0,
               progress=False)
  return tmp_path / 'ds'


def test_sampler_windows_come_from_the_split(tmp_path, seed):
  ds = _dataset(tmp_path, seed)
  for split in data.SPLITS:
    tokens = _read(ds / f'{split}.bin')
    sampler = data.BatchSampler(ds, split, batch_size=5, seq_len=16, seed=3)
    assert sampler.num_tokens == len(tokens) and sampler.vocab_size == 256
    batch = next(sampler)
    assert batch.shape == (5, 17) and batch.dtype == np.int32
    windows = np.lib.stride_tricks.sliding_window_view(tokens, 17)
    for row in batch:
      assert (windows == row).all(axis=1).any()


def test_val_split_is_disjoint_from_train(tmp_path):
  src = tmp_path / 'src.txt'
  # The last 10% of the stream is digits, the rest letters: each split sees only its own.
  src.write_bytes(b'abcdefghij' * 90 + b'0123456789' * 10)
  data.prepare([src], tmp_path / 'ds', val_fraction=0.1, min_val_tokens=0, progress=False)
  train = data.BatchSampler(tmp_path / 'ds', 'train', 8, 12, seed=0)
  val = data.BatchSampler(tmp_path / 'ds', 'val', 8, 12, seed=0)
  for _ in range(20):
    assert (np.array(list(b'abcdefghij'))[None, None, :] == next(train)[..., None]).any(-1).all()
    assert (next(val) < ord('a')).all()


def test_sampler_is_deterministic_and_resumes_exactly(tmp_path, seed):
  ds = _dataset(tmp_path, seed)
  sampler_seed = seed % 1000
  straight = data.BatchSampler(ds, 'train', 4, 8, sampler_seed)
  expected = [next(straight) for _ in range(10)]

  first = data.BatchSampler(ds, 'train', 4, 8, sampler_seed)
  got = [next(first) for _ in range(4)]
  saved = json.loads(json.dumps(first.state()))
  assert saved == {'step': 4, 'seed': sampler_seed}
  resumed = data.BatchSampler(ds, 'train', 4, 8, seed=sampler_seed + 1)
  resumed.restore(saved)
  got += [next(resumed) for _ in range(6)]
  for a, b in zip(got, expected):
    np.testing.assert_array_equal(a, b)
  other = data.BatchSampler(ds, 'train', 4, 8, sampler_seed + 1)
  assert not all(np.array_equal(next(other), e) for e in expected[:3])
  # Different steps give different windows.
  assert not np.array_equal(expected[0], expected[1])


@pytest.mark.parametrize('state', [{'step': 1}, {'step': -1, 'seed': 0}, [1, 2]])
def test_bad_sampler_state_is_refused(tmp_path, state, seed):
  sampler = data.BatchSampler(_dataset(tmp_path, seed), 'train', 2, 4, 0)
  with pytest.raises(ValueError, match='sampler state'):
    sampler.restore(state)


def test_dataset_errors_name_the_file(tmp_path, seed):
  with pytest.raises(ValueError, match='does not exist'):
    data.load_meta(tmp_path / 'nowhere')
  with pytest.raises(ValueError, match='meta.json not found'):
    data.load_meta(tmp_path)
  ds = _dataset(tmp_path, seed)
  meta_text = (ds / 'meta.json').read_text()
  (ds / 'meta.json').write_text('{"vocab_size": 256,')
  with pytest.raises(ValueError, match='meta.json is not valid JSON'):
    data.BatchSampler(ds, 'train', 2, 4, 0)
  (ds / 'meta.json').write_text(json.dumps({'vocab_size': 256}))
  with pytest.raises(ValueError, match='meta.json lacks dtype'):
    data.load_meta(ds)
  (ds / 'meta.json').write_text(meta_text)
  with open(ds / 'val.bin', 'ab') as f:
    f.write(b'\0')
  with pytest.raises(ValueError, match='val.bin has .* bytes'):
    data.load_meta(ds)
  (ds / 'val.bin').unlink()
  with pytest.raises(ValueError, match='val.bin not found'):
    data.load_meta(ds)


def test_split_too_small_for_a_window(tmp_path, seed):
  ds = _dataset(tmp_path, seed, val_fraction=0.001)
  with pytest.raises(ValueError, match='val.bin holds .* fewer than seq_len'):
    data.BatchSampler(ds, 'val', 2, 64, 0)


def test_the_validation_split_is_raised_to_its_minimum_with_a_warning(tmp_path, capsys, seed):
  """1% of 3000 tokens is 30, too few for any useful window: the split is raised to
  `min_val_tokens` (the tail of the stream still), and prepare says so."""
  rng = np.random.default_rng(seed)
  src = tmp_path / 'src.txt'
  text = bytes(rng.integers(32, 127, 3000, dtype=np.uint8))
  src.write_bytes(text)
  meta = data.prepare([src], tmp_path / 'ds', val_fraction=0.01, min_val_tokens=500)
  assert (meta.train_tokens, meta.val_tokens) == (2500, 500)
  np.testing.assert_array_equal(_read(tmp_path / 'ds' / 'val.bin'),
                                np.frombuffer(text[-500:], np.uint8))
  assert 'validation split raised from 30 to 500 tokens' in capsys.readouterr().err
  # A corpus smaller than twice the minimum gives half of itself, and says it is too small.
  meta = data.prepare([src], tmp_path / 'ds2', val_fraction=0.01, min_val_tokens=2000)
  assert (meta.train_tokens, meta.val_tokens) == (1500, 1500)
  assert 'too small' in capsys.readouterr().err


def test_bad_inputs(tmp_path):
  with pytest.raises(ValueError, match='input .*missing.txt does not exist'):
    data.prepare([tmp_path / 'missing.txt'], tmp_path / 'ds', progress=False)
  (tmp_path / 'empty').mkdir()
  with pytest.raises(ValueError, match='no text found'):
    data.prepare([tmp_path / 'empty'], tmp_path / 'ds', progress=False)
  assert not (tmp_path / 'ds').exists()
  with pytest.raises(ValueError, match='val_fraction'):
    data.prepare(None, tmp_path / 'ds', val_fraction=1.0)


@pytest.mark.parametrize('kwargs, culprit', [
    (dict(seq_len=0), 'seq_len'), (dict(batch_size=2.5), 'batch_size'),
    (dict(val_fraction=-0.1), 'val_fraction'), (dict(seed=-1), 'seed'), (dict(path=3), 'path'),
])
def test_bad_data_config_names_the_field(kwargs, culprit):
  with pytest.raises(ValueError, match=f'DataConfig.{culprit}'):
    data.DataConfig(**kwargs)


# ----- tokenizer.json -----


def _write_tokenizer_json(path):
  tokenizers = pytest.importorskip('tokenizers')
  vocab = {'[UNK]': 0, 'alpha': 1, 'beta': 2, 'gamma': 3, 'delta': 4}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token='[UNK]'))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(path))
  return tok


def test_tokenizer_json_is_used(tmp_path):
  tok = _write_tokenizer_json(tmp_path / 'tokenizer.json')
  src = tmp_path / 'src.txt'
  src.write_text('alpha beta gamma delta omega ' * 50)
  meta = data.prepare([src], tmp_path / 'ds', tokenizer_path=tmp_path / 'tokenizer.json',
                      val_fraction=0.0, progress=False)
  assert meta.vocab_size == 5 and meta.tokenizer == str((tmp_path / 'tokenizer.json').resolve())
  assert len(meta.tokenizer_sha256) == 64
  np.testing.assert_array_equal(_read(tmp_path / 'ds' / 'train.bin'),
                                tok.encode(src.read_text()).ids)


def test_tokenizer_file_errors(tmp_path, monkeypatch):
  with pytest.raises(ValueError, match='tokenizer file .*nope.json'):
    tokenizer_lib.load_tokenizer(tmp_path / 'nope.json')
  bad = tmp_path / 'bad.json'
  bad.write_text('{"not": "a tokenizer"}')
  if importlib.util.find_spec('tokenizers'):
    with pytest.raises(ValueError, match='bad.json is not a valid tokenizer.json'):
      tokenizer_lib.load_tokenizer(bad)
  # Without the package installed, the error says what to install.
  monkeypatch.setitem(sys.modules, 'tokenizers', None)
  with pytest.raises(ValueError, match='pip install tokenizers'):
    tokenizer_lib.load_tokenizer(bad)
