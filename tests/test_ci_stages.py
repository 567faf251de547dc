"""`.ci/run` names the files its no-skip stages run; a test file added elsewhere must be
named there too, or CI never runs it (stage 1b collects files, not the whole folder,
because the compiled-program modules skip at import where no CUDA plugin is installed)."""

import pathlib
import re
import subprocess
import sys

import pytest

from tests import compiled
from tests import conftest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _stage_1b_hf_files() -> set[str]:
  run = (ROOT / '.ci' / 'run').read_text(encoding='utf-8')
  line = next(l for l in run.splitlines() if l.startswith('tier "stage 1b, hf"'))
  return set(re.findall(r'tests/\S+\.py', line))


def test_every_hf_marked_file_runs_in_stage_1b():
  marked = {f'tests/{p.name}' for p in sorted((ROOT / 'tests').glob('test_*.py'))
            if re.search(r'^pytestmark\s*=.*pytest\.mark\.hf\b|@pytest\.mark\.hf\b',
                         p.read_text(encoding='utf-8'), re.M)}
  assert marked, 'no test file marks `hf`: the pattern above no longer matches'
  listed = _stage_1b_hf_files()
  assert marked <= listed, f'hf-marked files missing from .ci/run stage 1b: {sorted(marked - listed)}'
  missing = {f for f in listed if not (ROOT / f).exists()}
  assert not missing, f'.ci/run stage 1b names files that do not exist: {sorted(missing)}'


def test_every_test_file_ci_names_exists():
  """A renamed or deleted test file named in `.ci/run` would make pytest exit 4 there."""
  run = (ROOT / '.ci' / 'run').read_text(encoding='utf-8')
  code = '\n'.join(l for l in run.splitlines() if not l.lstrip().startswith('#'))
  named = set(re.findall(r'tests/[\w/]+\.(?:py|txt)', code))
  assert named, 'no test file named in .ci/run: the pattern above no longer matches'
  missing = sorted(f for f in named if not (ROOT / f).exists())
  assert not missing, f'.ci/run names files that do not exist: {missing}'


def _listed(name: str) -> list[str]:
  return sorted(conftest.node_ids(str(ROOT / 'tests' / name)))


@pytest.mark.parametrize('name', ['slow_tier.txt', 'stage_2c_leaves_out.txt'])
def test_every_listed_node_id_names_a_test_that_exists(name):
  """A renamed test left in tests/slow_tier.txt would silently run in the default tier,
  one left in tests/stage_2c_leaves_out.txt in stage 2c: each line's file exists and
  defines the test function it names."""
  lines = _listed(name)
  assert lines
  missing = []
  for line in lines:
    path, _, test = line.partition('::')
    function = test.split('[')[0]
    source = ROOT / path
    if not source.exists() or not re.search(rf'^def {re.escape(function)}\(',
                                            source.read_text(encoding='utf-8'), re.M):
      missing.append(line)
  assert not missing, f'tests/{name} names tests that do not exist: {missing}'


def test_stage_2c_leaves_out_no_known_regression():
  """A known regression's strict xfail must run on the version it is known for, to flip
  once it holds; stage 2c leaves out none of any version's."""
  known = set(compiled.KNOWN_REGRESSIONS_ALL_VERSIONS)
  for by_version in compiled._KNOWN_BY_VERSION.values():  # pylint: disable=protected-access
    known |= set(by_version)
  listed = set(_listed('stage_2c_leaves_out.txt'))
  assert not listed & known, sorted(listed & known)


def test_stage_2c_passes_its_list():
  run = (ROOT / '.ci' / 'run').read_text(encoding='utf-8').replace('\\\n', ' ')
  command = next(l for l in run.splitlines() if l.startswith('tier "stage 2c'))
  assert '--leave-out tests/stage_2c_leaves_out.txt' in command, command


def _collected(*args: str) -> list[str]:
  """The node ids pytest collects from this file with `args` (`--collect-only`)."""
  out = subprocess.run(
      [sys.executable, '-m', 'pytest', '--collect-only', '-q', '-n', '0', '-p',
       'no:cacheprovider', 'tests/test_ci_stages.py', *args],
      cwd=ROOT, capture_output=True, text=True, check=True, timeout=600).stdout
  return [l for l in out.splitlines() if l.startswith('tests/test_ci_stages.py::')]


def test_the_stage_options_select_what_they_say(tmp_path):
  """`--first-parameter-set` (stage 2b) keeps the first item of each function, and
  every unparametrized one; `--leave-out FILE` (stage 2c) drops exactly FILE's ids."""
  every = _collected()
  listed = [n for n in every if n.split('::')[1].startswith('test_every_listed_node_id')]
  assert len(listed) == 2, every
  assert _collected('--first-parameter-set') == [n for n in every if n != listed[1]]
  left_out = tmp_path / 'left_out.txt'
  left_out.write_text(f'# a comment\n\n{listed[0]}\n', encoding='utf-8')
  assert _collected('--leave-out', str(left_out)) == [n for n in every if n != listed[0]]
