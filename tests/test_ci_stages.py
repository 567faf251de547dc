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
