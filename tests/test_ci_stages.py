"""`.ci/run` names the files its no-skip stages run; a test file added elsewhere must be
named there too, or CI never runs it (stage 1b collects files, not the whole folder,
because the compiled-program modules skip at import where no CUDA plugin is installed)."""

import pathlib
import re

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


def test_every_slow_tier_line_names_a_test_that_exists():
  """A renamed test left in tests/slow_tier.txt would silently run in the default tier:
  each line's file exists and defines the test function it names."""
  lines = [l.strip() for l in (ROOT / 'tests' / 'slow_tier.txt').read_text().splitlines()
           if l.strip() and not l.startswith('#')]
  assert lines
  missing = []
  for line in lines:
    path, _, test = line.partition('::')
    name = test.split('[')[0]
    source = ROOT / path
    if not source.exists() or not re.search(rf'^def {re.escape(name)}\(',
                                            source.read_text(encoding='utf-8'), re.M):
      missing.append(line)
  assert not missing, f'tests/slow_tier.txt names tests that do not exist: {missing}'
