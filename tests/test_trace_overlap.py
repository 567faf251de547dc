"""experiments/trace_overlap.py on synthetic Chrome traces with known intervals.

The script reads real `jax.profiler` traces on a GPU that nobody has seen yet; these
check its interval arithmetic, which events it counts on which rows, the op names it
takes from compiled HLO, and that it finds the file a profiler run leaves.
"""

import gzip
import importlib.util
import json
import os
import pathlib
import sys

import pytest

_PATH = pathlib.Path(__file__).parent.parent / 'experiments' / 'trace_overlap.py'
_SPEC = importlib.util.spec_from_file_location('trace_overlap', _PATH)
trace_overlap = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = trace_overlap  # dataclasses look their module up there
_SPEC.loader.exec_module(trace_overlap)

GPU, HOST = 1, 2  # pids
STREAM, XLA_OPS, PYTHON, WORKER, WORKER2 = 10, 11, 20, 21, 22  # tids


def _meta():
  return [
      {'ph': 'M', 'pid': GPU, 'name': 'process_name', 'args': {'name': '/device:GPU:0'}},
      {'ph': 'M', 'pid': HOST, 'name': 'process_name', 'args': {'name': '/host:CPU'}},
      {'ph': 'M', 'pid': GPU, 'tid': STREAM, 'name': 'thread_name',
       'args': {'name': 'Stream #13(Compute)'}},
      {'ph': 'M', 'pid': GPU, 'tid': XLA_OPS, 'name': 'thread_name', 'args': {'name': 'XLA Ops'}},
      {'ph': 'M', 'pid': HOST, 'tid': PYTHON, 'name': 'thread_name', 'args': {'name': 'python'}},
  ]


def _x(pid, tid, name, ts, dur, **args):
  event = {'ph': 'X', 'pid': pid, 'tid': tid, 'name': name, 'ts': ts, 'dur': dur}
  if args:
    event['args'] = {'_src': 'xla/thunk.cc', **args}
  return event


def _known_trace(shift=1000.0):
  return {'traceEvents': _meta() + [
      # Device: [0,150] (two overlapping kernels) + [400,450] = 200 us.
      _x(GPU, STREAM, 'dos_jax_adamw', shift + 0, 100),
      _x(GPU, STREAM, 'dos_jax_adamw', shift + 50, 100),
      _x(GPU, STREAM, 'triton_kernel', shift + 400, 50, hlo_op='custom-call.7'),
      _x(GPU, STREAM, 'memcpy_htod', shift + 0, 1000),  # a copy: not update work
      _x(GPU, XLA_OPS, 'dos_jax_adamw', shift + 600, 100),  # derived row: ignored
      # Host: [100,300] + [250,500] on two threads = [100,500] = 400 us.
      _x(HOST, WORKER, 'ffi_call.0', shift + 100, 200, hlo_op='ffi_call.0'),
      _x(HOST, WORKER2, 'HostExecuteStartThunk', shift + 250, 250),
      _x(HOST, WORKER, 'other_fusion', shift + 0, 2000, hlo_op='other_fusion'),
      _x(HOST, PYTHON, '$python frame dos_jax_adamw_host', shift + 0, 5000),  # Python: ignored
      {'ph': 'i', 'pid': HOST, 'tid': WORKER, 'name': 'dos_jax_adamw_host', 'ts': shift},
  ]}


def test_union_and_intersection():
  u = trace_overlap.union([(5, 6), (0, 2), (1, 3), (3, 4)])
  assert u == [(0, 4), (5, 6)]
  assert trace_overlap.length(u) == 5
  assert trace_overlap.intersect(u, [(1, 5.5), (5.75, 10)]) == [(1, 4), (5, 5.5), (5.75, 6)]
  assert trace_overlap.intersect(u, []) == []


def test_known_intervals_with_hlo_op_names():
  result = trace_overlap.analyze(_known_trace(), trace_overlap.Patterns(),
                                 device_ops=frozenset({'custom-call.7'}),
                                 host_ops=frozenset({'ffi_call.0'}))
  assert (result.device_ms, result.host_ms) == (0.2, 0.4)
  # Overlap: [100,150] + [400,450] = 100 us, half of the shorter (device) side.
  assert result.overlap_ms == 0.1 and result.share == 0.5
  assert result.span_ms == 0.5
  assert result.line() == 'host 0.4 ms, device 0.2 ms, overlap 0.1 ms (50% of min(host, device))'
  assert result.matched[('device', 'dos_jax_adamw')][0] == 2
  assert ('device', 'memcpy_htod') in result.unmatched
  assert ('host', 'other_fusion') in result.unmatched


def test_without_hlo_only_patterns_match():
  result = trace_overlap.analyze(_known_trace(), trace_overlap.Patterns())
  # custom-call.7 and ffi_call.0 are unknown now: device [0,150], host [250,500].
  assert (result.device_ms, result.host_ms, result.overlap_ms) == (0.15, 0.25, 0.0)


def test_patterns_and_rows_are_adjustable():
  patterns = trace_overlap.Patterns(device='memcpy', host='other_fusion', device_thread='.')
  result = trace_overlap.analyze(_known_trace(shift=0), patterns)
  # Device: the copy [0,1000]; the XLA Ops row now counts but has no copy. Host [0,2000].
  assert (result.device_ms, result.host_ms, result.overlap_ms) == (1.0, 2.0, 1.0)
  assert result.share == 1.0


def test_disjoint_work_has_no_overlap_and_empty_sides_are_zero():
  trace = {'traceEvents': _meta() + [_x(GPU, STREAM, 'dos_jax_adamw', 0, 10),
                                     _x(HOST, WORKER, 'dos_jax_adamw_host_rows', 10, 10)]}
  result = trace_overlap.analyze(trace)
  assert (result.device_ms, result.host_ms, result.overlap_ms) == (0.01, 0.01, 0.0)
  empty = trace_overlap.analyze({'traceEvents': []})
  assert (empty.device_ms, empty.host_ms, empty.overlap_ms, empty.share) == (0, 0, 0, 0)


def test_hlo_ops_takes_matching_custom_calls():
  text = '''
  %fusion.1 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused, metadata={op_name="dos_jax_adamw_host"}
  ffi_call.0 = (f32[2,3,4]{2,1,0}) custom-call(%a, %b), custom_call_target="dos_jax_adamw_host_leaves"
  ROOT %custom-call.7 = (f32[8]{0}) custom-call(%c), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"dos_jax_adamw"}
  '''
  assert trace_overlap.hlo_ops(text, trace_overlap.HOST_PATTERN) == {'ffi_call.0'}
  assert trace_overlap.hlo_ops(text, trace_overlap.DEVICE_PATTERN) == {'custom-call.7'}


def test_finds_the_newest_trace_and_reports(tmp_path, capsys):
  for run, when in (('2026_01_01_00_00_00', 1), ('2026_01_01_00_00_09', 2)):
    folder = tmp_path / 'plugins' / 'profile' / run
    folder.mkdir(parents=True)
    path = folder / 'host.trace.json.gz'
    trace = _known_trace() if when == 2 else {'traceEvents': []}
    with gzip.open(path, 'wt') as f:
      json.dump(trace, f)
    os.utime(path, (when, when))
  (tmp_path / 'step.hlo.txt').write_text(
      'ffi_call.0 = f32[1] custom-call(), custom_call_target="dos_jax_adamw_host_rows"\n')
  assert trace_overlap.find_trace(str(tmp_path)).endswith('00_09/host.trace.json.gz')
  code = trace_overlap.main(['--trace-dir', str(tmp_path), '--hlo', str(tmp_path / 'step.hlo.txt')])
  out = capsys.readouterr().out
  assert code == 0
  # Device [0,150] (custom-call.7 is not in this HLO), host [100,500]: overlap 50 us.
  assert 'SUMMARY host 0.4 ms, device 0.1 ms, overlap 0.1 ms (33% of min(host, device))' in out
  assert 'host, not matched' in out and 'other_fusion' in out
  with pytest.raises(FileNotFoundError):
    trace_overlap.find_trace(str(tmp_path / 'plugins' / 'nothing'))
