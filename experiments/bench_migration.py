"""What a plan change costs: `dos_jax.migrate` against a full copy of the state.

The two-memory program stores its state per subgroup (one block per subgroup), so a
plan change moves only the subgroups whose tier changes. The state of `--params`
elements is made under the first of `--plans`, then moved through the others in order,
twice round (the first round compiles whatever needs compiling; the second is
reported). Each move is timed and the memory it adds is measured while the old state
is still held, as a caller holds it until the move returns: the bytes of the new
arrays that share no buffer with the old state (exact), the change in the process's
resident memory (host memory, pinned included, and on a CPU-only machine device memory
too; the allocator can hide some of it by reusing memory it freed before) and, on an
accelerator, the device's bytes in use. The reference is a full copy of the state
before the move (every array copied where it is, `jax.device_put(..., may_alias=False)`),
timed the same way: the ratio columns are the move over the copy. A move should add
only the rows that change memory.

(Stacked storage of the two-memory program, which this compared before, is gone:
issue 40.)

  python experiments/bench_migration.py --params 2e8 --subgroup-size 1e7 --platform gpu
  python experiments/bench_migration.py --params 1e9 --subgroup-size 1e8 --dtype bf16 \\
      --json $OUT/migration.json

On a CPU-only machine pass `--platform gpu`: the two-memory program's tiers (the
CPU program keeps one array, so it has nothing to move between host tiers).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import jax

import dos_jax
from dos_jax.geometry.partition import Partition
from dos_jax.geometry.partition import Tier
from bench_update import parse_policy  # pylint: disable=import-error
from bench_update import synthetic  # pylint: disable=import-error

DEFAULT_PLANS = 'AllHost,Stride(2),ResidentFraction(0.3),DeviceFraction(0.25),AllDevice'
_DTYPES = {'fp32': 'float32', 'float32': 'float32', 'bf16': 'bfloat16', 'bfloat16': 'bfloat16'}


def resident_bytes() -> int:
  """The process's resident memory (Linux /proc), in bytes."""
  with open('/proc/self/statm') as f:
    return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


def device_bytes() -> int | None:
  """Bytes in use on the first device, where the backend reports it."""
  stats = jax.devices()[0].memory_stats() if jax.default_backend() != 'cpu' else None
  return None if not stats else int(stats.get('bytes_in_use', 0))


def new_buffer_bytes(old, new) -> int:
  """Bytes of the arrays of `new` that do not share a buffer with an array of `old`:
  what the move allocated, exactly (resident memory can hide it when the allocator
  reuses memory it freed before)."""
  held = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(old)}
  return sum(x.nbytes for x in jax.tree.leaves(new) if x.unsafe_buffer_pointer() not in held)


def moved_rows(old: Partition, new: Partition) -> tuple[int, int]:
  """(rows that change memory, rows that change tier within host memory)."""
  crossing = within = 0
  for g in range(old.num_subgroups):
    a, b = old.tier_of(g), new.tier_of(g)
    if (a is Tier.RESIDENT) != (b is Tier.RESIDENT):
      crossing += 1
    elif a is not b:
      within += 1
  return crossing, within


def full_copy(state):
  """Every array of `state` copied where it is (same sharding and memory kind)."""
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), state)


def run_moves(params, policies, args) -> list[dict]:
  """Every move of two rounds through `policies`, each with a full copy of the state it
  starts from; the second round's rows."""
  offload = dos_jax.Offload(subgroup_size=args.subgroup_size, policy=policies[0][1])
  implementation = dos_jax.Implementation(program=args.platform)
  state = jax.block_until_ready(
      dos_jax.adamw(1e-3, offload=offload, implementation=implementation).init(params))
  spec = state.layout.spec()
  row_bytes = sum(x.nbytes for x in jax.tree.leaves(state)) / spec.num_subgroups
  order = list(policies[1:]) + [policies[0]]
  rows = []
  for round_ in range(2):
    for name, policy in order:
      start = time.perf_counter()
      copy = jax.block_until_ready(full_copy(state))
      copy_seconds = time.perf_counter() - start
      copy_bytes = new_buffer_bytes(state, copy)
      del copy
      plan = policy.plan(spec)
      host0, dev0 = resident_bytes(), device_bytes()
      start = time.perf_counter()
      new = jax.block_until_ready(dos_jax.migrate(state, plan))
      seconds = time.perf_counter() - start
      host1, dev1 = resident_bytes(), device_bytes()
      crossing, within = moved_rows(state.partition, new.partition)
      if round_:
        rows.append({
            'to': name, 'seconds': seconds, 'new_bytes': new_buffer_bytes(state, new),
            'host_added': host1 - host0,
            'device_added': None if dev0 is None else dev1 - dev0,
            'copy_seconds': copy_seconds, 'copy_bytes': copy_bytes,
            'rows_crossing': crossing, 'rows_within_host': within, 'row_bytes': row_bytes})
      state = new  # the old state goes now, as a caller's would
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  number = lambda s: int(float(s))
  parser.add_argument('--params', type=number, default=200_000_000)
  parser.add_argument('--subgroup-size', type=number, default=10_000_000)
  parser.add_argument('--dtype', choices=sorted(_DTYPES), default='float32')
  parser.add_argument('--plans', default=DEFAULT_PLANS,
                      help=f'comma-separated policies, visited in order (default {DEFAULT_PLANS})')
  parser.add_argument('--platform', choices=['cpu', 'gpu'], default=None,
                      help="Implementation(program=...); default: the backend's own program")
  parser.add_argument('--json', default=None, help='write the results here as JSON too')
  args = parser.parse_args(argv)
  specs = [s.strip() for s in re.findall(r'[^,(]+(?:\([^)]*\))?', args.plans) if s.strip()]
  try:
    policies = [(s, parse_policy(s)) for s in specs]
  except argparse.ArgumentTypeError as e:
    parser.error(str(e))
  if len(policies) < 2:
    parser.error('--plans needs at least two policies')
  params, _ = synthetic(args.params, jax.numpy.dtype(_DTYPES[args.dtype]))
  header = (f'{args.params / 1e6:.0f}M {args.dtype} params, subgroup {args.subgroup_size:,},'
            f' {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__},'
            f' platform {args.platform or "backend"}')
  print(header)
  rows = run_moves(params, policies, args)
  mib = lambda b: 'n/a' if b is None else f'{b / 2**20:8.1f}'
  print(f'{"move to":<22} {"rows x/in":>9}  {"move s":>9} {"new MiB":>8} {"RSS MiB":>8}   '
        f'{"copy s":>9} {"new MiB":>8}   {"time":>5} {"new":>5}')
  for r in rows:
    ratio_s = r['seconds'] / r['copy_seconds'] if r['copy_seconds'] else float('nan')
    ratio_m = r['new_bytes'] / r['copy_bytes'] if r['copy_bytes'] else float('nan')
    print(f'{r["to"]:<22} {r["rows_crossing"]:>4}/{r["rows_within_host"]:<4}  '
          f'{r["seconds"]:9.3f} {mib(r["new_bytes"])} {mib(r["host_added"])}   '
          f'{r["copy_seconds"]:9.3f} {mib(r["copy_bytes"])}   {ratio_s:5.2f}x {ratio_m:5.2f}x')
    if r['device_added'] is not None:
      print(f'{"":<22} device MiB added: {mib(r["device_added"])}')
  print(f'one row (subgroup) of state: {mib(rows[0]["row_bytes"]).strip()} MiB')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump({'header': header, 'config': vars(args), 'results': rows}, f, indent=1)
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
