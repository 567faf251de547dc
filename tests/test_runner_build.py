"""setup.py reuses a native library whose inputs are unchanged (`pip install -e .` used
to recompile every library, ~48 s, on every reinstall) and rebuilds after any change.

The compiler is replaced by a stub that writes random bytes, so the test runs in a
second and checks only the decision: which libraries would be compiled.
"""

import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_DRIVER = '''
import os, sys
import setuptools.command.build_ext as be
built = []
def fake_build(self, ext):
  built.append(ext.name.rsplit('.', 1)[1])
  target = self.get_ext_fullpath(ext.name)
  os.makedirs(os.path.dirname(target), exist_ok=True)
  with open(target, 'wb') as f:
    f.write(os.urandom(64))
be.build_ext.build_extension = fake_build
sys.argv = ['setup.py', 'build_ext', '--inplace']
code = compile(open('setup.py').read(), 'setup.py', 'exec')
exec(code, {'__file__': 'setup.py', '__name__': '__main__'})
print('BUILT', ','.join(sorted(built)))
'''


def _built(tmp_path) -> list[str]:
  done = subprocess.run([sys.executable, '-c', _DRIVER], cwd=tmp_path, capture_output=True,
                        text=True, timeout=120, check=True)
  line = [x for x in done.stdout.splitlines() if x.startswith('BUILT')][-1]
  return [name for name in line[len('BUILT '):].split(',') if name]


def test_build_ext_rebuilds_only_what_changed(tmp_path):
  for name in ('setup.py', 'pyproject.toml', 'README.md'):
    shutil.copy2(os.path.join(REPO, name), tmp_path / name)
  os.makedirs(tmp_path / 'kernels')
  for name in os.listdir(os.path.join(REPO, 'kernels')):
    if name.endswith(('.cc', '.h', '.py')):
      shutil.copy2(os.path.join(REPO, 'kernels', name), tmp_path / 'kernels' / name)
  every = ['_host_adamw8', '_host_adamw_disk', '_host_adamw_rows', '_host_isa']
  assert _built(tmp_path) == every  # No library yet.
  assert _built(tmp_path) == []  # Nothing changed: all reused.
  with open(tmp_path / 'kernels' / 'adamw_loop.h', 'a', encoding='utf-8') as f:
    f.write('// an edit\n')
  assert _built(tmp_path) == every  # A header all include.
  assert _built(tmp_path) == []
  with open(tmp_path / 'kernels' / 'host_isa.cc', 'a', encoding='utf-8') as f:
    f.write('// an edit\n')
  assert _built(tmp_path) == ['_host_isa']  # One library's own source.
  library = next(p for p in os.listdir(tmp_path / 'kernels')
                 if p.startswith('_host_adamw_rows') and p.endswith('.so'))
  (tmp_path / 'kernels' / library).write_bytes(b'a library from elsewhere')
  assert _built(tmp_path) == ['_host_adamw_rows']  # Not the library the stamp describes.
  text = (tmp_path / 'setup.py').read_text()
  (tmp_path / 'setup.py').write_text(text.replace("'-O3'", "'-O2'"))
  assert _built(tmp_path) == every  # Flags.
