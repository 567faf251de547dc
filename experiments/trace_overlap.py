"""How long host-update and device-update work overlapped in one profiled step.

The method's claim is that the host subgroups' update (native AdamW in a host region)
runs while the device subgroups are updated (Pallas AdamW on a GPU stream). A
`jax.profiler` trace shows whether it does. This script

1. (run mode, the default) takes a trace of one donated Stride(2) update + apply step
   on synthetic params (`--params`, bf16), after two warm-up steps (the second call of
   a fresh state compiles again), and saves it with the step's compiled HLO under
   `--out` (`trace/`, `step.hlo.txt`);
2. (both modes) reads the Chrome-trace file the profiler writes
   (`plugins/profile/<run>/<host>.trace.json.gz`, gzip + json only, the newest run), and
   prints the union of device-update intervals, the union of host-update intervals and
   the length of their intersection:
   "host X ms, device Y ms, overlap Z ms (Z/min(X,Y) %)", then a breakdown of the
   busiest event names on each side, matched or not, to check the patterns against.

Parse an existing trace with other patterns (no JAX needed):

  python experiments/trace_overlap.py --trace-dir $OUT/trace --hlo $OUT/step.hlo.txt \
      --host-pattern 'dos_jax_adamw_host|my_host_op'

Which events count (regular expressions, `re.search`; nobody has seen a real GPU trace
of this program yet, so every one is a flag and the breakdown shows what is there):

- The event's text is its name plus the string values of its args (`hlo_op`,
  `hlo_module`, `long_name`, ... but not `_src`). Only complete events (`ph == 'X'`)
  with a duration count; Python-tracer events (names starting with `$`) never do.
- Device update (`--device-pattern`, default `dos_jax_adamw(?!_host)`: the Pallas
  kernel's name): events in a process whose name matches `--device-process` (default
  `/device:GPU`) on a thread whose name matches `--device-thread` (default `Stream`:
  the CUDA stream rows, not the derived "XLA Ops"/"XLA Modules" rows), whose text
  matches the pattern or whose `hlo_op` is a device-kernel op of the compiled HLO.
- Host update (`--host-pattern`, default `dos_jax_adamw_host|host[-_ ]?execute`
  (case-insensitive): the native custom calls `dos_jax_adamw_host_rows` /
  `_rows_out_in` / `_leaves`, or XLA's host-execute work): events in every other
  process, whose text matches the pattern or whose `hlo_op` is a host-kernel op of the
  compiled HLO. Caveat: if XLA's host-execute *done* event is a wait, it spans device
  time too and inflates the overlap; the breakdown shows which names were matched.
- Compiled HLO (`--hlo`, written by run mode): instruction lines that are custom calls
  and match a pattern give their instruction names; an event whose `hlo_op` is one of
  them matches too. XLA:CPU names the native call's events by instruction (e.g.
  `ffi_call.0`), not by target, so this is how the host kernel is found on a CPU.

On a CPU backend there is no device process: "device 0 ms" is expected there; the
run only checks that the trace is found and parsed.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import sys
import time

DEVICE_PATTERN = r'dos_jax_adamw(?!_host)'
HOST_PATTERN = r'(?i)dos_jax_adamw_host|host[-_ ]?execute'
DEVICE_PROCESS = r'/device:GPU'
DEVICE_THREAD = r'Stream'
_NOT_TEXT = ('_src',)  # args that name the profiler's source file, never the op


# ----------------------------------------------------------------------------- intervals


def union(intervals) -> list[tuple[float, float]]:
  """Sorted, disjoint intervals covering the same points as `intervals`."""
  merged: list[list[float]] = []
  for start, end in sorted(intervals):
    if merged and start <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], end)
    else:
      merged.append([start, end])
  return [(s, e) for s, e in merged]


def length(intervals) -> float:
  return sum(end - start for start, end in intervals)


def intersect(a, b) -> list[tuple[float, float]]:
  """Intersection of two sorted, disjoint interval lists (as `union` returns)."""
  out, i, j = [], 0, 0
  while i < len(a) and j < len(b):
    start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
    if start < end:
      out.append((start, end))
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return out


# ----------------------------------------------------------------------------- trace


@dataclasses.dataclass(frozen=True)
class Patterns:
  """What counts as device-update and host-update work (see the module docstring)."""

  device: str = DEVICE_PATTERN
  host: str = HOST_PATTERN
  device_process: str = DEVICE_PROCESS
  device_thread: str = DEVICE_THREAD


def find_trace(directory: str) -> str:
  """The newest `*.trace.json.gz` under `directory` (a log dir, or a run dir in it)."""
  files = glob.glob(os.path.join(directory, '**', '*.trace.json.gz'), recursive=True)
  if not files:
    raise FileNotFoundError(f'no *.trace.json.gz under {directory}')
  return max(files, key=os.path.getmtime)


def load_trace(path: str) -> dict:
  with gzip.open(path, 'rt') as f:
    return json.load(f)


def hlo_ops(hlo_text: str, pattern: str) -> set[str]:
  """Names of the custom-call instructions of an HLO module's text matching `pattern`."""
  ops = set()
  for line in hlo_text.splitlines():
    if 'custom-call(' not in line and 'custom_call_target' not in line:
      continue
    match = re.match(r'\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=', line)
    if match and re.search(pattern, line):
      ops.add(match.group(1))
  return ops


def _text(event: dict) -> str:
  args = event.get('args') or {}
  values = [str(v) for k, v in args.items() if k not in _NOT_TEXT and isinstance(v, str)]
  return ' | '.join([event.get('name', ''), *values])


@dataclasses.dataclass
class Result:
  host_ms: float
  device_ms: float
  overlap_ms: float
  span_ms: float  # first matched start to last matched end, both sides
  # (side, name) -> [count, total ms], for the breakdown; side is 'device' or 'host'.
  matched: dict = dataclasses.field(default_factory=dict)
  unmatched: dict = dataclasses.field(default_factory=dict)

  @property
  def share(self) -> float:
    """Overlap as a fraction of the shorter side (0 when a side is empty)."""
    shorter = min(self.host_ms, self.device_ms)
    return self.overlap_ms / shorter if shorter > 0 else 0.0

  def line(self) -> str:
    return (f'host {self.host_ms:.1f} ms, device {self.device_ms:.1f} ms, overlap '
            f'{self.overlap_ms:.1f} ms ({100 * self.share:.0f}% of min(host, device))')


def analyze(trace: dict, patterns: Patterns = Patterns(),
            device_ops: frozenset = frozenset(), host_ops: frozenset = frozenset()) -> Result:
  """Device, host and overlapping milliseconds of a Chrome trace (`ts`/`dur` in us)."""
  events = trace.get('traceEvents', []) if isinstance(trace, dict) else trace
  process, thread = {}, {}
  for e in events:
    if e.get('ph') == 'M' and e.get('name') == 'process_name':
      process[e.get('pid')] = (e.get('args') or {}).get('name', '')
    elif e.get('ph') == 'M' and e.get('name') == 'thread_name':
      thread[(e.get('pid'), e.get('tid'))] = (e.get('args') or {}).get('name', '')
  spans = {'device': [], 'host': []}
  matched = collections.defaultdict(lambda: [0, 0.0])
  unmatched = collections.defaultdict(lambda: [0, 0.0])
  for e in events:
    if e.get('ph') != 'X' or 'dur' not in e or e.get('name', '').startswith('$'):
      continue
    pid = e.get('pid')
    on_device = bool(re.search(patterns.device_process, process.get(pid, '')))
    if on_device and not re.search(patterns.device_thread, thread.get((pid, e.get('tid')), '')):
      continue  # derived rows (XLA Ops, XLA Modules, Steps) repeat the stream events
    side = 'device' if on_device else 'host'
    op = (e.get('args') or {}).get('hlo_op')
    pattern, ops = (patterns.device, device_ops) if on_device else (patterns.host, host_ops)
    start, dur = float(e['ts']), float(e['dur'])
    stats = unmatched
    if (op is not None and op in ops) or re.search(pattern, _text(e)):
      spans[side].append((start, start + dur))
      stats = matched
    stats[(side, e.get('name', ''))][0] += 1
    stats[(side, e.get('name', ''))][1] += dur / 1e3
  device, host = union(spans['device']), union(spans['host'])
  both = union(device + host)
  return Result(host_ms=length(host) / 1e3, device_ms=length(device) / 1e3,
                overlap_ms=length(intersect(device, host)) / 1e3,
                span_ms=(both[-1][1] - both[0][0]) / 1e3 if both else 0.0,
                matched=dict(matched), unmatched=dict(unmatched))


def breakdown(result: Result, top: int = 12) -> str:
  """The busiest event names per side, matched and not: what to adjust patterns with."""
  lines = []
  for side in ('device', 'host'):
    for title, stats in (('matched', result.matched), ('not matched', result.unmatched)):
      rows = sorted(((n, c, ms) for (s, n), (c, ms) in stats.items() if s == side),
                    key=lambda r: -r[2])
      lines.append(f'{side}, {title}: {len(rows)} names'
                   + ('' if not rows else f', busiest {min(top, len(rows))}:'))
      lines += [f'  {ms:10.2f} ms  {count:6d} x  {name[:100]}' for name, count, ms in rows[:top]]
  return '\n'.join(lines)


def report(trace_path: str, patterns: Patterns, hlo_path: str | None = None) -> Result:
  """Analyzes one trace file and prints the breakdown and the result line."""
  device_ops = host_ops = frozenset()
  if hlo_path:
    with open(hlo_path) as f:
      text = f.read()
    device_ops, host_ops = (frozenset(hlo_ops(text, p)) for p in (patterns.device, patterns.host))
    print(f'HLO {hlo_path}: device-kernel ops {sorted(device_ops)}, '
          f'host-kernel ops {sorted(host_ops)}')
  start = time.perf_counter()
  trace = load_trace(trace_path)
  result = analyze(trace, patterns, device_ops, host_ops)
  print(f'trace {trace_path} ({os.path.getsize(trace_path) / 1e6:.1f} MB, '
        f'{len(trace.get("traceEvents", []))} events, read in '
        f'{time.perf_counter() - start:.1f} s)')
  print(f'patterns: device {patterns.device!r} on process {patterns.device_process!r} '
        f'thread {patterns.device_thread!r}; host {patterns.host!r}')
  print(breakdown(result))
  print(f'matched work spans {result.span_ms:.1f} ms')
  print(result.line())
  return result


# ----------------------------------------------------------------------------- run mode


def profile_step(params_count: int, subgroup_size: int, out: str, platform: str | None):
  """Traces one donated Stride(2) step on bf16 params; returns (trace dir, HLO path)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  import dos_jax  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from bench_update import synthetic  # pylint: disable=import-outside-toplevel

  print(f'{params_count / 1e6:.0f}M bf16 params, subgroup {subgroup_size:,}, Stride(2), '
        f'{jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}')
  clock = time.perf_counter()
  params, grads = synthetic(params_count, jnp.bfloat16)
  opt = dos_jax.adamw(
      1e-3, offload=dos_jax.Offload(subgroup_size=subgroup_size, policy=dos_jax.Stride(2)),
      implementation=dos_jax.Implementation(program=platform))
  state = jax.block_until_ready(opt.init(params))
  print(f'init: {time.perf_counter() - clock:.1f} s')

  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(step, donate_argnums=(0, 1))
  for i in range(2):
    clock = time.perf_counter()
    params, state = jax.block_until_ready(step(params, state, grads))
    print(f'warm-up step {i + 1}: {time.perf_counter() - clock:.2f} s')
  hlo_path = os.path.join(out, 'step.hlo.txt')
  try:
    with open(hlo_path, 'w') as f:
      f.write(step.lower(params, state, grads).compile().as_text())
  except Exception as e:  # pylint: disable=broad-except
    print(f'could not write the compiled HLO ({type(e).__name__}: {e}); matching by name only')
    hlo_path = None
  trace_dir = os.path.join(out, 'trace')
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0  # Python frames: megabytes of events, none of interest
  clock = time.perf_counter()
  with jax.profiler.trace(trace_dir, profiler_options=options):
    start = time.perf_counter()
    params, state = jax.block_until_ready(step(params, state, grads))
    print(f'profiled step: {time.perf_counter() - start:.3f} s')
  print(f'trace written in {time.perf_counter() - clock:.1f} s to {trace_dir}')
  return trace_dir, hlo_path


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--trace-dir', default=None,
                      help='parse an existing trace (a jax.profiler log dir) instead of running')
  parser.add_argument('--hlo', default=None, help='compiled HLO text for op names (parse mode)')
  parser.add_argument('--params', type=lambda s: int(float(s)), default=1_000_000_000)
  parser.add_argument('--subgroup-size', type=lambda s: int(float(s)), default=100_000_000)
  parser.add_argument('--platform', choices=['cpu', 'gpu'], default=None,
                      help="Implementation(program=...): 'gpu' builds the two-memory program "
                      'anywhere')
  parser.add_argument('--out', default=None, help='where run mode writes trace/ and step.hlo.txt')
  parser.add_argument('--device-pattern', default=DEVICE_PATTERN)
  parser.add_argument('--host-pattern', default=HOST_PATTERN)
  parser.add_argument('--device-process', default=DEVICE_PROCESS)
  parser.add_argument('--device-thread', default=DEVICE_THREAD)
  args = parser.parse_args(argv)
  patterns = Patterns(args.device_pattern, args.host_pattern, args.device_process,
                      args.device_thread)

  on_gpu = False
  if args.trace_dir:
    trace_dir, hlo_path = args.trace_dir, args.hlo
  else:
    out = args.out or 'experiments/gpu_check_out'
    os.makedirs(out, exist_ok=True)
    trace_dir, hlo_path = profile_step(args.params, args.subgroup_size, out, args.platform)
    import jax  # pylint: disable=import-outside-toplevel
    on_gpu = jax.default_backend() == 'gpu'
  result = report(find_trace(trace_dir), patterns, hlo_path)
  print(f'SUMMARY {result.line()}')
  if on_gpu and (result.host_ms == 0 or result.device_ms == 0):
    print('a side matched no event on a GPU: adjust the patterns with the breakdown above '
          f'and re-run with --trace-dir {trace_dir}' + (f' --hlo {hlo_path}' if hlo_path else ''))
    return 3
  return 0


if __name__ == '__main__':
  sys.exit(main())
