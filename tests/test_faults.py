"""Faults of the machine, broken for real: a full disk (a small tmpfs), a read-only
checkpoint folder (a read-only bind mount), SIGKILL during a save, and a second run
on a running run's folder. After each, the run says what happened in one line, leaves
no half-written checkpoint, and a resume ends exactly (bit for bit) where one
uninterrupted run ends.

The mounts need root (CI runs as root); where mounting is not permitted those tests
skip with one line. Runs that must be killed or run beside another are subprocesses;
the rest, and every resume, run in this process through `dos-jax train` itself.
"""

import doctest
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from dos_jax import cli
from dos_jax.train import checkpoint, faults, integrity, rundir
from dos_jax.train.progress import MetricsLog, read_metrics
from tests.test_runner_reliability import dataset  # pylint: disable=unused-import  (the fixture)
from tests.test_runner_reliability import SMALL

STEPS, EVERY = 8, 2
# One run of the module: checkpoints at 2, 4, 6, 8; loss and eval loss compared bit for bit.
RUN = [*SMALL, f'train.steps={STEPS}', f'checkpoint.every={EVERY}', 'checkpoint.keep=3']


def _args(dataset, out_dir, *extra):
  args = ['train']
  for item in [f'data.path={dataset}', *RUN, f'train.out_dir={out_dir}', *extra]:
    args += ['--set', item]
  return args


def _train(dataset, out_dir, capsys, *extra) -> tuple[int, str]:
  capsys.readouterr()
  code = cli.main(_args(dataset, out_dir, *extra))
  return code, capsys.readouterr().err


def _outcome(out_dir) -> dict:
  """What must match the uninterrupted run: every step's loss (each logged once) and the
  end-of-run eval loss and summary."""
  records = read_metrics(os.path.join(out_dir, 'metrics.jsonl'))
  losses = [(r['step'], r['loss'], r['grad_norm']) for r in records if 'loss' in r]
  summary = [r for r in records if r.get('summary')][-1]
  return {'losses': losses, 'final_loss': summary['final_loss'],
          'eval_loss': summary['eval_loss'], 'final_step': summary['final_step']}


def _no_debris(ckpt_dir) -> None:
  names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
  assert not [n for n in names if checkpoint.TMP_MARK in n], names
  for name in names:  # Every finished checkpoint is complete and intact.
    if name.isdigit():
      integrity.verify(os.path.join(ckpt_dir, name))


@pytest.fixture(scope='module')
def reference(dataset, tmp_path_factory):
  """The uninterrupted run, in this process (as the resumes): its outcome."""
  out = str(tmp_path_factory.mktemp('reference') / 'run')
  assert cli.main(_args(dataset, out)) == 0
  return {'outcome': _outcome(out), 'checkpoint_bytes': _dir_bytes(
      os.path.join(out, 'checkpoints', str(STEPS)))}


def _dir_bytes(path) -> int:
  return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _mount(*args) -> None:
  subprocess.run(['mount', *args], check=True, capture_output=True, text=True)


def _umount(path) -> None:
  subprocess.run(['umount', path], check=False, capture_output=True)


@pytest.fixture
def tmpfs(tmp_path):
  """mount(size) -> a fresh tmpfs of `size` bytes; unmounted after the test."""
  mounted = []

  def mount(size: int) -> str:
    where = tmp_path / f'tmpfs{len(mounted)}'
    where.mkdir()
    try:
      _mount('-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(where))
    except (OSError, subprocess.CalledProcessError) as err:
      pytest.skip(f'cannot mount a tmpfs here ({getattr(err, "stderr", err)!s:.80})')
    mounted.append(str(where))
    return str(where)

  yield mount
  for where in reversed(mounted):
    _umount(where)


@pytest.mark.parametrize('fail_at', [EVERY, 3 * EVERY], ids=['first_save', 'later_save'])
def test_disk_full_names_no_space_leaves_no_debris_and_resumes_exactly(
    dataset, reference, tmpfs, capsys, fail_at
):
  """The run folder on a tmpfs that holds fewer checkpoints than the run keeps: the save
  at `fail_at` fails. One line, exit 1: 'no space', the folder, the bytes needed and
  free, checkpoint.keep and checkpoint.dir, and the last complete checkpoint; no
  temporary folder is left. After the tmpfs grows, the rerun resumes from that
  checkpoint and ends exactly as the uninterrupted run."""
  size = reference['checkpoint_bytes']
  fits = fail_at // EVERY - 1  # Checkpoints that fit before the failing save.
  where = tmpfs(int((fits + 0.6) * size) + 64 * 1024)
  out = os.path.join(where, 'run')
  ckpt_dir = os.path.join(out, 'checkpoints')
  code, err = _train(dataset, out, capsys)
  assert code == 1, err[-3000:]
  assert 'Traceback' not in err and 'ERROR:absl' not in err, err[-3000:]
  lines = [line for line in err.splitlines() if line.startswith('dos-jax: error:')]
  assert len(lines) == 1, err[-3000:]
  line = lines[0]
  assert f'no space left on the device of {ckpt_dir} while writing checkpoint' in line, line
  assert 'free' in line and 'a checkpoint needs about' in line and 'MiB' in line
  assert 'checkpoint.keep=3' in line and f'checkpoint.dir (now {ckpt_dir})' in line
  if fits:
    assert 'the last complete checkpoint is ' in line, line
    last = int(line.split('the last complete checkpoint is ')[1].split()[0].split('/')[-1])
    assert last >= EVERY * fits and str(last) in os.listdir(ckpt_dir)
    log = os.path.join(out, 'error.log')
  else:  # Nothing saved: the run folder is gone, the log is in the temporary folder.
    assert 'no checkpoint was saved' in line
    assert not os.path.exists(out)
    log = line.split('(details in ')[1].rstrip(')')
  with open(log, encoding='utf-8') as f:
    assert 'No space left on device' in f.read()
  if not fits:
    os.unlink(log)
  _no_debris(ckpt_dir)

  _mount('-o', 'remount,size=64m', where)  # Space freed; the files stay.
  code, err = _train(dataset, out, capsys)
  assert code == 0, err[-3000:]
  if fits:
    assert f'resumed from {ckpt_dir} at step {last}' in err
  assert _outcome(out) == reference['outcome']
  _no_debris(ckpt_dir)


@pytest.mark.slow
def test_read_only_checkpoint_folder_is_named_and_the_run_resumes_exactly(
    dataset, reference, jax_cache, tmp_path, capsys
):
  """The checkpoint folder turns read-only (a read-only bind mount over it) once the
  first checkpoint is complete: the next save fails with one line naming the folder and
  'read-only', exit 1, and the run ends at once. A rerun while it is read-only is
  refused before writing (exit 2, the folder named); once writable again, the rerun
  resumes exactly."""
  out = str(tmp_path / 'run')
  ckpt_dir = os.path.join(out, 'checkpoints')
  proc = _start(dataset, out, jax_cache)
  mounted = False
  try:
    complete = None
    for step in range(EVERY, STEPS, EVERY):  # Between two saves: none in progress.
      done = os.path.join(ckpt_dir, str(step), integrity.MANIFEST)
      _stop_when(proc, lambda done=done: os.path.exists(done), f'checkpoint {step}')
      if not any(n != str(step) and int(n.split('.')[0]) > step
                 for n in _names(ckpt_dir) if n[0].isdigit()):
        complete = step
        break
      proc.send_signal(signal.SIGCONT)
    assert complete is not None, 'never stopped between two saves'
    try:
      _mount('--bind', ckpt_dir, ckpt_dir)
      mounted = True
      _mount('-o', 'remount,bind,ro', ckpt_dir)
    except (OSError, subprocess.CalledProcessError) as err:
      pytest.skip(f'cannot make a read-only bind mount here ({getattr(err, "stderr", err)!s:.80})')
    proc.send_signal(signal.SIGCONT)
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 1, err[-3000:]
    assert 'Traceback' not in err and 'ERROR:absl' not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith('dos-jax: error:')]
    assert len(lines) == 1, err[-3000:]
    assert (f'{ckpt_dir} is on a read-only file system (writing checkpoint'
            f' {complete + EVERY})') in lines[0], lines
    assert f'the last complete checkpoint is {ckpt_dir}/{complete} ' in lines[0], lines

    code, err = _train(dataset, out, capsys)
    assert code == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith('dos-jax: error:')]
    assert len(lines) == 1, err[-3000:]
    assert (f'checkpoint.dir: {ckpt_dir} cannot be written ({ckpt_dir} is on a read-only'
            ' file system)') in lines[0], lines
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()
    if mounted:
      _umount(ckpt_dir)
  code, err = _train(dataset, out, capsys)
  assert code == 0, err[-3000:]
  assert f'resumed from {ckpt_dir} at step {complete}' in err
  assert _outcome(out) == reference['outcome']
  _no_debris(ckpt_dir)


def _env(cache_dir):
  env = dict(os.environ)
  env['JAX_PLATFORMS'] = 'cpu'
  # The devices this process has (conftest), so that its programs are the very same.
  env['XLA_FLAGS'] = os.environ.get('XLA_FLAGS', '')
  env['JAX_COMPILATION_CACHE_DIR'] = str(cache_dir)
  env['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
  env['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'
  return env


@pytest.fixture(scope='module')
def jax_cache(tmp_path_factory):
  return tmp_path_factory.mktemp('jax_cache')


def _start(dataset, out_dir, cache, *extra) -> subprocess.Popen:
  cmd = [sys.executable, '-m', 'dos_jax.cli', *_args(dataset, out_dir, *extra)]
  return subprocess.Popen(cmd, env=_env(cache), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)


def _stop_when(proc, seen, what, timeout=300.0) -> None:
  """Polls until `seen()` holds, then stops the process (SIGSTOP) and checks `seen()`
  again, so that the state it is stopped in is the state looked for; a state that has
  passed meanwhile lets it go on (SIGCONT) to the next chance."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise AssertionError(f'run ended (rc={proc.returncode}) before {what}:'
                           f' {proc.stderr.read()[-3000:]}')
    if seen():
      proc.send_signal(signal.SIGSTOP)
      time.sleep(0.01)
      if seen():
        return
      proc.send_signal(signal.SIGCONT)
    time.sleep(0.0005)
  proc.kill()
  raise AssertionError(f'timed out waiting for {what}')


@pytest.mark.slow
def test_second_run_on_a_running_folder_exits_2_and_the_first_run_is_complete(
    dataset, reference, jax_cache, tmp_path, capsys
):
  """A second `dos-jax train` on the folder of a run in progress stops at once: exit 2,
  one line naming the first run's PID and host; it writes nothing, and the first run
  ends with every step logged once, exactly as the uninterrupted run."""
  out = str(tmp_path / 'run')
  proc = _start(dataset, out, jax_cache)
  try:
    metrics = os.path.join(out, 'metrics.jsonl')
    _stop_when(proc, lambda: os.path.exists(metrics) and os.path.getsize(metrics) > 0,
               'the first step')
    with open(os.path.join(out, rundir.LOCK_FILE), encoding='utf-8') as f:
      assert json.load(f)['pid'] == proc.pid
    before = open(metrics, 'rb').read()
    code, err = _train(dataset, out, capsys)
    assert code == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith('dos-jax: error:')]
    assert len(lines) == 1 and len(err.strip().splitlines()) == 1, err
    assert (f'{out} is in use by another run (pid {proc.pid} on host'
            f' {socket.gethostname()},') in lines[0], lines
    assert open(metrics, 'rb').read() == before
  finally:
    proc.send_signal(signal.SIGCONT)
    err = proc.communicate(timeout=300)[1]
  assert proc.returncode == 0, err[-3000:]
  assert _outcome(out) == reference['outcome']
  assert not os.path.exists(os.path.join(out, rundir.LOCK_FILE))
  _no_debris(os.path.join(out, 'checkpoints'))


def _saving(ckpt_dir):
  return lambda: any(checkpoint.TMP_MARK in n for n in _names(ckpt_dir))


def _partly_written(ckpt_dir):
  """A save part-way through: its temporary folder already holds a written file."""
  def seen():
    for n in _names(ckpt_dir):
      if checkpoint.TMP_MARK in n:
        for _, _, files in os.walk(os.path.join(ckpt_dir, n)):
          if files:
            return True
    return False
  return seen


def _unmanifested(ckpt_dir):
  def seen():
    return any(n.isdigit() and not integrity.has_manifest(os.path.join(ckpt_dir, n))
               for n in _names(ckpt_dir))
  return seen


def _names(ckpt_dir) -> list[str]:
  try:
    return os.listdir(ckpt_dir)
  except OSError:
    return []


def _rows_since_resume(metrics) -> list[dict]:
  """The step records this run wrote (after the newest 'resumed_from' marker)."""
  records = read_metrics(metrics) if os.path.exists(metrics) else []
  marks = [i for i, r in enumerate(records) if 'resumed_from' in r]
  return [r for r in records[marks[-1] + 1 if marks else 0:] if 'loss' in r]


@pytest.mark.slow
def test_sigkill_during_saves_never_leaves_a_checkpoint_that_restores_wrong(
    dataset, reference, jax_cache, tmp_path, capsys
):
  """One run killed (SIGKILL) three times during a save: while orbax writes its
  temporary folder, after orbax's rename but before the checksum manifest, and once
  the temporary folder holds written files (a save part-way through). Each restart says which checkpoint it resumes from, and that a
  cut-short one was discarded; the last one ends exactly as the uninterrupted run, with
  each step logged once."""
  out = str(tmp_path / 'run')
  ckpt_dir = os.path.join(out, 'checkpoints')

  # (what, when to kill, extra settings of the killed run): checkpointing every step
  # gives the short window between rename and manifest more chances to be caught.
  points = [('temporary folder', _saving(ckpt_dir), []),
            ('renamed, no manifest', _unmanifested(ckpt_dir), ['checkpoint.every=1']),
            ('files written into a save', _partly_written(ckpt_dir), [])]
  at_kill = []
  for what, seen, extra in points:
    proc = _start(dataset, out, jax_cache, *extra)
    try:
      _stop_when(proc, seen, what)
      at_kill.append(sorted(_names(ckpt_dir)))
    finally:
      proc.kill()
      err = proc.communicate(timeout=60)[1]
    assert proc.returncode == -signal.SIGKILL
    if len(at_kill) > 1:  # This start saw the previous kill's leftovers.
      _check_restart(err, at_kill[-2], ckpt_dir)
  print('checkpoint folder at each kill:', at_kill)
  assert any(checkpoint.TMP_MARK in n for n in at_kill[0]), at_kill
  assert any(n.isdigit() and not integrity.has_manifest(os.path.join(ckpt_dir, n))
             or n.endswith('.damaged') for n in at_kill[1] + _names(ckpt_dir)), at_kill

  code, err = _train(dataset, out, capsys)
  assert code == 0, err[-3000:]
  assert 'Traceback' not in err
  _check_restart(err, at_kill[-1], ckpt_dir)
  assert _outcome(out) == reference['outcome']
  _no_debris(ckpt_dir)


def _check_restart(err: str, left: list[str], ckpt_dir: str) -> None:
  """What a start after a kill says: each cut-short save discarded, the step resumed."""
  for name in left:
    if checkpoint.TMP_MARK in name:
      assert f'checkpoint {name.split(".")[0]} was cut short ({name}' in err, err[-3000:]
  complete = [int(n) for n in left if n.isdigit()
              and integrity.has_manifest(os.path.join(ckpt_dir, n))]
  if complete:
    assert f'resumed from {ckpt_dir} at step {max(complete)}' in err, err[-3000:]


def test_a_failed_saves_stray_task_errors_go_to_its_error_log(tmp_path, capsys):
  """orbax's asyncio tasks of a failed save report their exceptions only when collected:
  leaving RunLog collects them into the error.log it wrote, not onto the terminal (at
  exit, or inside a later run of the same process, where a test once caught one)."""
  import asyncio  # pylint: disable=import-outside-toplevel
  import gc  # pylint: disable=import-outside-toplevel

  async def write_fragment():
    raise OSError(28, 'No space left on device')

  async def save():
    task = asyncio.ensure_future(write_fragment())
    await asyncio.sleep(0)  # the task fails; nothing retrieves its exception
    cycle = {'task': task}
    cycle['self'] = cycle  # freed only by the garbage collector, as orbax's are

  gc.disable()  # so that only RunLog's collection can report the task
  try:
    with faults.RunLog() as log:
      asyncio.run(save())
      path = log.write(OSError(28, 'No space left on device'), str(tmp_path))
  finally:
    gc.enable()
    gc.collect()  # what RunLog left is reported now, to the terminal
  text = open(path, encoding='utf-8').read()
  assert 'Task exception was never retrieved' in text, text
  assert text.count('No space left on device') >= 2, text  # the run's error and the task's
  assert 'Traceback' not in capsys.readouterr().err


def test_lock_names_its_holder_and_is_released_with_the_file(tmp_path):
  """In one process, as across processes: flock locks belong to the open file, so a
  second RunLock on the folder is refused while the first is held."""
  held = rundir.RunLock(str(tmp_path / 'run'))
  with pytest.raises(rundir.RunLocked) as refused:
    rundir.RunLock(str(tmp_path / 'run'))
  assert (f'train.out_dir: {tmp_path / "run"} is in use by another run (pid {os.getpid()}'
          f' on host {socket.gethostname()}, since ') in str(refused.value)
  other = rundir.RunLock(str(tmp_path / 'run'), process_index=1)  # Same run, process 1.
  assert sorted(os.listdir(tmp_path / 'run')) == ['run.lock', 'run.lock.1']
  other.release()
  held.release()
  assert os.listdir(tmp_path / 'run') == []
  rundir.RunLock(str(tmp_path / 'run')).release()


def test_metrics_are_cut_back_in_place_on_resume(tmp_path):
  """A resume at step 2 cuts the records of steps 3-4 and a line cut short by a kill off
  the end of the same file (same inode: truncated, not rewritten), then appends."""
  path = str(tmp_path / 'metrics.jsonl')
  log = MetricsLog(path, resume_step=0)
  for step in range(1, 5):
    log.write({'step': step, 'loss': 1.0 / step})
  log.close()
  with open(path, 'a', encoding='utf-8') as f:
    f.write('{"step": 5, "lo')
  inode = os.stat(path).st_ino
  MetricsLog(path, resume_step=2).close()
  assert os.stat(path).st_ino == inode
  records = read_metrics(path)
  assert [r.get('step', r.get('resumed_from')) for r in records] == [1, 2, 2]
  assert records[:2] == [{'step': 1, 'loss': 1.0}, {'step': 2, 'loss': 0.5}]


@pytest.mark.parametrize('module', [faults, rundir], ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
  result = doctest.testmod(module)
  assert result.attempted > 0 and result.failed == 0
