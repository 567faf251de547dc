"""The interval arithmetic of experiments/trace_overlap.py on a synthetic Chrome trace."""

import importlib.util
import pathlib

import numpy as np

_PATH = pathlib.Path(__file__).parent.parent / 'experiments' / 'trace_overlap.py'
_SPEC = importlib.util.spec_from_file_location('trace_overlap', _PATH)
trace_overlap = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(trace_overlap)


def _event(name, ts, dur):
  return {'ph': 'X', 'name': name, 'ts': ts, 'dur': dur}


def test_overlap_of_known_intervals():
  rng = np.random.default_rng()
  shift = float(rng.integers(0, 1000))
  events = [
      _event('dos_jax_adamw', shift + 0, 100), _event('dos_jax_adamw', shift + 50, 100),
      _event('dos_jax_adamw', shift + 400, 50),  # device: [0,150] + [400,450] = 200 us
      _event('dos_jax_adamw_host_leaves', shift + 100, 400),  # host: [100,500] = 400 us
      _event('other', shift + 0, 1000), {'ph': 'i', 'name': 'dos_jax_adamw', 'ts': 3},
  ]
  got = trace_overlap.overlap({'traceEvents': events}, r'dos_jax_adamw(?!_host)',
                              r'dos_jax_adamw_host')
  # overlap: [100,150] + [400,450] = 100 us
  assert got == {'device_ms': 0.2, 'host_ms': 0.4, 'overlap_ms': 0.1}


def test_disjoint_work_has_no_overlap():
  events = [_event('dev', 0, 10), _event('host', 10, 10)]
  assert trace_overlap.overlap({'traceEvents': events}, 'dev', 'host')['overlap_ms'] == 0
