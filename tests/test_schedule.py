"""Reading scheduled HLO (dos_jax.dataflow.hlo / schedule) on small modules with known answers.

The modules are written the way XLA:GPU prints a compiled program (async copies to memory
space 5, a host call as `custom-call-start`/`-done` on the "host" execution thread); the
answers are counted by hand. Runs everywhere: no plugin, no compile.
"""

import pytest

from dos_jax.dataflow import hlo
from dos_jax.dataflow.schedule import Schedule

_MODULE = '''HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[64,64]{1,0})->f32[64,64]{1,0}}

%gemm_fusion_dot.1_computation (p0: f32[64,64], p1: f32[64,64]) -> f32[64,64] {
  %p0 = f32[64,64]{1,0} parameter(0)
  %p1 = f32[64,64]{1,0} parameter(1)
  ROOT %dot.1 = f32[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_loop (q0: f32[64,64]) -> f32[64,64] {
  %q0 = f32[64,64]{1,0} parameter(0)
  ROOT %neg = f32[64,64]{1,0} negate(%q0)
}

%host_computation (state: f32[4,3,1024], g: f32[64,64]) -> f32[4,3,1024] {
  %state = f32[4,3,1024]{2,1,0} parameter(0)
  %g = f32[64,64]{1,0} parameter(1)
  ROOT %ffi = f32[4,3,1024]{2,1,0} custom-call(%state, %g), custom_call_target="dos_jax_adamw_host_leaves"
}, execution_thread="host"

%body (arg: (s32[], f32[2,3,1024])) -> (s32[], f32[2,3,1024]) {
  %arg = (s32[], f32[2,3,1024]{2,1,0:S(5)}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %rows = f32[2,3,1024]{2,1,0:S(5)} get-tuple-element(%arg), index=1
  %row = f32[1,3,1024]{2,1,0} dynamic-slice(%rows, %i, %i, %i), dynamic_slice_sizes={1,3,1024}
  %k = f32[1,3,1024]{2,1,0} custom-call(%row), custom_call_target="__gpu$xla.gpu.triton"
  %new = f32[2,3,1024]{2,1,0:S(5)} dynamic-update-slice(%rows, %k, %i, %i, %i)
  ROOT %t = (s32[], f32[2,3,1024]{2,1,0:S(5)}) tuple(%i, %new)
}

ENTRY %main (x: f32[64,64], w: f32[64,64], state: f32[4,3,1024], streamed: f32[2,3,1024]) -> f32[64,64] {
  %x = f32[64,64]{1,0} parameter(0)
  %w = f32[64,64]{1,0} parameter(1)
  %state = f32[4,3,1024]{2,1,0:S(5)} parameter(2)
  %streamed = f32[2,3,1024]{2,1,0:S(5)} parameter(3)
  %raw = f32[64,64]{1,0} fusion(%w), kind=kLoop, calls=%fused_loop
  %copy-start.0 = (f32[64,64]{1,0:S(5)}, f32[64,64]{1,0}, u32[]) copy-start(%w)
  %gemm_fusion_dot.1 = f32[64,64]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %copy-start.1 = (f32[64,64]{1,0:S(5)}, f32[64,64]{1,0}, u32[]) copy-start(%gemm_fusion_dot.1)
  %gemm_fusion_dot.2 = f32[64,64]{1,0} fusion(%gemm_fusion_dot.1, %w), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %copy-done.0 = f32[64,64]{1,0:S(5)} copy-done(%copy-start.0)
  %copy-done.1 = f32[64,64]{1,0:S(5)} copy-done(%copy-start.1)
  %copy-start.2 = (f32[64,64]{1,0:S(5)}, f32[64,64]{1,0}, u32[]) copy-start(%gemm_fusion_dot.2)
  %copy-done.2 = f32[64,64]{1,0:S(5)} copy-done(%copy-start.2)
  %call-start = ((f32[4,3,1024]{2,1,0:S(5)}, f32[64,64]{1,0:S(5)}), f32[4,3,1024]{2,1,0:S(5)}, u32[]) custom-call-start(%state, %copy-done.1), async_execution_thread="host", custom_call_target="HostExecute", called_computations={%host_computation}
  %tuple.0 = (s32[], f32[2,3,1024]{2,1,0:S(5)}) tuple(%x, %streamed)
  %while.0 = (s32[], f32[2,3,1024]{2,1,0:S(5)}) while(%tuple.0), condition=%body, body=%body
  %call-done = f32[4,3,1024]{2,1,0:S(5)} custom-call-done(%call-start)
  %copy.5 = f32[4,3,1024]{2,1,0:S(5)} copy(%call-done)
  ROOT %out = f32[64,64]{1,0} fusion(%gemm_fusion_dot.2), kind=kLoop, calls=%fused_loop
}
'''


def test_module_parses_computations_shapes_and_memory_spaces():
  module = hlo.Module.parse(_MODULE)
  assert module.is_scheduled and module.entry == 'main'
  assert module.computations['host_computation'].execution_thread == 'host'
  entry = module.entry_computation.by_name()
  start = entry['call-start']
  assert start.opcode == 'custom-call-start'
  assert start.operands == ('state', 'copy-done.1')
  assert start.called == ('host_computation',)
  arrays = start.arrays
  assert [a.dims for a in arrays] == [(4, 3, 1024), (64, 64), (4, 3, 1024), ()]
  assert [a.on_host for a in arrays] == [True, True, True, False]
  assert entry['copy.5'].arrays[0].nbytes == 4 * 3 * 1024 * 4
  assert [c.name for c in module.reachable('main')][:1] == ['main']


def test_schedule_facts():
  schedule = Schedule.from_text(_MODULE)
  assert schedule.gemms == 2
  copies = {c.name: c for c in schedule.copies}
  assert set(copies) == {'copy-start.0', 'copy-start.1', 'copy-start.2'}
  # copy 0 sends a parameter as it is: not a gradient; copy 2 has nothing in flight.
  assert not copies['copy-start.0'].after_gemm
  assert copies['copy-start.1'].gemms_between == 1 and copies['copy-start.1'].overlaps_compute
  assert not copies['copy-start.2'].overlaps_compute
  grads = schedule.gradient_copies(min_bytes=1)
  assert [c.name for c in grads] == ['copy-start.1', 'copy-start.2']
  [call] = schedule.host_calls
  assert call.device_between == ('while.0',)
  assert call.device_update_between == ('while.0',)  # its body runs a Pallas kernel
  assert schedule.device_update_inside_host_call()
  [copy] = schedule.large_host_copies(min_bytes=1)
  assert (copy.name, copy.nbytes) == ('copy.5', 4 * 3 * 1024 * 4)
  summary = schedule.summary(min_copy_bytes=1, min_host_copy_bytes=1)
  assert summary['gradient_copies'] == 2
  assert summary['gradient_copies_overlapping_compute'] == 1
  assert summary['large_host_to_host_copies'] == 1
  assert summary['host_calls_starting_before_last_gemm'] == 0
  assert summary['gemms_inside_host_calls'] == 0


def test_a_host_call_started_before_the_last_gemm_is_counted_with_the_gemms_inside():
  """The summary's early-chunk facts: the host call issued before the second gemm."""
  lines = _MODULE.splitlines()
  start = next(line for line in lines if '%call-start = ' in line)
  lines.remove(start)
  lines.insert(next(i for i, line in enumerate(lines) if '%gemm_fusion_dot.2 = ' in line),
               start)
  summary = Schedule.from_text('\n'.join(lines)).summary()
  assert summary['host_calls_starting_before_last_gemm'] == 1
  assert summary['gemms_inside_host_calls'] == 1


def test_device_work_after_the_host_call_is_not_inside_it():
  text = _MODULE.replace(
      '  %while.0 = (s32[], f32[2,3,1024]{2,1,0:S(5)}) while(%tuple.0), condition=%body, body=%body\n'
      '  %call-done = f32[4,3,1024]{2,1,0:S(5)} custom-call-done(%call-start)\n',
      '  %call-done = f32[4,3,1024]{2,1,0:S(5)} custom-call-done(%call-start)\n'
      '  %while.0 = (s32[], f32[2,3,1024]{2,1,0:S(5)}) while(%tuple.0), condition=%body, body=%body\n')
  assert text != _MODULE
  assert not Schedule.from_text(text).device_update_inside_host_call()


def test_an_unscheduled_module_is_refused():
  with pytest.raises(ValueError, match='not a scheduled HLO module'):
    Schedule.from_text(_MODULE.replace('is_scheduled=true', 'is_scheduled=false'))


def _stream_module(second_fetch_reads: str) -> str:
  """A loop body streaming two rows of a stacked host tier, written as XLA:GPU prints
  the compiled stream: async dynamic-slice fetches into device memory and async
  dynamic-update-slice write-backs, as `fusion-start`/`-done` pairs. (Rows of 96 KiB:
  the reader ignores moves under 64 KiB, which are no state blocks.)"""
  return f'''HloModule jit_stream, is_scheduled=true

%ds (a: f32[4,3,8192], i: s32[]) -> f32[1,3,8192] {{
  %a = f32[4,3,8192]{{2,1,0:S(5)}} parameter(0)
  %i = s32[] parameter(1)
  ROOT %s = f32[1,3,8192]{{2,1,0}} dynamic-slice(%a, %i, %i, %i), dynamic_slice_sizes={{1,3,8192}}
}}

%dus (a: f32[4,3,8192], u: f32[1,3,8192], i: s32[]) -> f32[4,3,8192] {{
  %a = f32[4,3,8192]{{2,1,0:S(5)}} parameter(0)
  %u = f32[1,3,8192]{{2,1,0}} parameter(1)
  %i = s32[] parameter(2)
  ROOT %w = f32[4,3,8192]{{2,1,0:S(5)}} dynamic-update-slice(%a, %u, %i, %i, %i)
}}

%body (arg: (s32[], f32[4,3,8192])) -> (s32[], f32[4,3,8192]) {{
  %arg = (s32[], f32[4,3,8192]{{2,1,0:S(5)}}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %tier = f32[4,3,8192]{{2,1,0:S(5)}} get-tuple-element(%arg), index=1
  %fetch-start.0 = ((f32[4,3,8192]{{2,1,0:S(5)}}, s32[]), f32[1,3,8192]{{2,1,0}}, u32[]) fusion-start(%tier, %i), kind=kLoop, calls=%wrapped_dynamic-slice_computation
  %fetch-done.0 = f32[1,3,8192]{{2,1,0}} fusion-done(%fetch-start.0)
  %k.0 = f32[1,3,8192]{{2,1,0}} custom-call(%fetch-done.0), custom_call_target="__gpu$xla.gpu.triton"
  %wb-start.0 = ((f32[4,3,8192]{{2,1,0:S(5)}}, f32[1,3,8192]{{2,1,0}}, s32[]), f32[4,3,8192]{{2,1,0:S(5)}}, u32[]) fusion-start(%tier, %k.0, %i), kind=kLoop, calls=%wrapped_dynamic-update-slice_computation
  %wb-done.0 = f32[4,3,8192]{{2,1,0:S(5)}} fusion-done(%wb-start.0)
  %fetch-start.1 = ((f32[4,3,8192]{{2,1,0:S(5)}}, s32[]), f32[1,3,8192]{{2,1,0}}, u32[]) fusion-start(%{second_fetch_reads}, %i), kind=kLoop, calls=%wrapped_dynamic-slice_computation
  %fetch-done.1 = f32[1,3,8192]{{2,1,0}} fusion-done(%fetch-start.1)
  %k.1 = f32[1,3,8192]{{2,1,0}} custom-call(%fetch-done.1), custom_call_target="__gpu$xla.gpu.triton"
  %wb-start.1 = ((f32[4,3,8192]{{2,1,0:S(5)}}, f32[1,3,8192]{{2,1,0}}, s32[]), f32[4,3,8192]{{2,1,0:S(5)}}, u32[]) fusion-start(%wb-done.0, %k.1, %i), kind=kLoop, calls=%wrapped_dynamic-update-slice_computation
  %wb-done.1 = f32[4,3,8192]{{2,1,0:S(5)}} fusion-done(%wb-start.1)
  ROOT %t = (s32[], f32[4,3,8192]{{2,1,0:S(5)}}) tuple(%i, %wb-done.1)
}}

ENTRY %main (tier: f32[4,3,8192]) -> (s32[], f32[4,3,8192]) {{
  %tier = f32[4,3,8192]{{2,1,0:S(5)}} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,3,8192]{{2,1,0:S(5)}}) tuple(%zero, %tier)
  ROOT %while.0 = (s32[], f32[4,3,8192]{{2,1,0:S(5)}}) while(%init), condition=%body, body=%body
}}
'''


@pytest.mark.parametrize('reads, prefetched', [('wb-done.0', False), ('tier', True)],
                         ids=['after_write_back', 'before_write_back'])
def test_a_fetch_after_the_previous_write_back_is_not_prefetched(reads, prefetched):
  """Row 2's fetch reading the tier as row 1 wrote it back is the serial stream
  (fetch, update, write back, next fetch); reading it as it was before is the prefetch."""
  schedule = Schedule.from_text(_stream_module(reads))
  rows = schedule.streamed_rows
  assert [(r.fetch, r.write_back) for r in rows] == [
      ('fetch-start.0', 'wb-start.0'), ('fetch-start.1', 'wb-start.1')]
  assert [r.after_previous_write_back for r in rows] == [False, not prefetched]
  assert schedule.stream_prefetched() is prefetched
  assert schedule.summary()['streamed_fetches_after_previous_write_back'] == (not prefetched)


def _duplex_module(write_back_waits: bool) -> str:
  """Two rows of a stacked tier in one loop body, the second fetched while the first is
  updated (a prefetch). With `write_back_waits`, the first row's write-back takes the
  tier through an optimization barrier with the second row's fetched block (what the
  streamed loop did to keep XLA from copying the tier): the two transfers then cannot
  be in flight together."""
  tier_for_write_back = '%tier2' if write_back_waits else '%tier'
  return f'''HloModule jit_duplex, is_scheduled=true

%body (arg: (s32[], f32[4,3,8192])) -> (s32[], f32[4,3,8192]) {{
  %arg = (s32[], f32[4,3,8192]{{2,1,0:S(5)}}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %tier = f32[4,3,8192]{{2,1,0:S(5)}} get-tuple-element(%arg), index=1
  %fetch-start.0 = ((f32[4,3,8192]{{2,1,0:S(5)}}, s32[]), f32[1,3,8192]{{2,1,0}}, u32[]) fusion-start(%tier, %i), kind=kLoop, calls=%wrapped_dynamic-slice_computation
  %fetch-done.0 = f32[1,3,8192]{{2,1,0}} fusion-done(%fetch-start.0)
  %fetch-start.1 = ((f32[4,3,8192]{{2,1,0:S(5)}}, s32[]), f32[1,3,8192]{{2,1,0}}, u32[]) fusion-start(%tier, %i), kind=kLoop, calls=%wrapped_dynamic-slice_computation
  %fetch-done.1 = f32[1,3,8192]{{2,1,0}} fusion-done(%fetch-start.1)
  %k.0 = f32[1,3,8192]{{2,1,0}} custom-call(%fetch-done.0), custom_call_target="__gpu$xla.gpu.triton"
  %tup = (f32[4,3,8192]{{2,1,0:S(5)}}, f32[1,3,8192]{{2,1,0}}) tuple(%tier, %fetch-done.1)
  %bar = (f32[4,3,8192]{{2,1,0:S(5)}}, f32[1,3,8192]{{2,1,0}}) opt-barrier(%tup)
  %tier2 = f32[4,3,8192]{{2,1,0:S(5)}} get-tuple-element(%bar), index=0
  %wb-start.0 = ((f32[4,3,8192]{{2,1,0:S(5)}}, f32[1,3,8192]{{2,1,0}}, s32[]), f32[4,3,8192]{{2,1,0:S(5)}}, u32[]) fusion-start({tier_for_write_back}, %k.0, %i), kind=kLoop, calls=%wrapped_dynamic-update-slice_computation
  %wb-done.0 = f32[4,3,8192]{{2,1,0:S(5)}} fusion-done(%wb-start.0)
  %k.1 = f32[1,3,8192]{{2,1,0}} custom-call(%fetch-done.1), custom_call_target="__gpu$xla.gpu.triton"
  %wb-start.1 = ((f32[4,3,8192]{{2,1,0:S(5)}}, f32[1,3,8192]{{2,1,0}}, s32[]), f32[4,3,8192]{{2,1,0:S(5)}}, u32[]) fusion-start(%wb-done.0, %k.1, %i), kind=kLoop, calls=%wrapped_dynamic-update-slice_computation
  %wb-done.1 = f32[4,3,8192]{{2,1,0:S(5)}} fusion-done(%wb-start.1)
  ROOT %t = (s32[], f32[4,3,8192]{{2,1,0:S(5)}}) tuple(%i, %wb-done.1)
}}

ENTRY %main (tier: f32[4,3,8192]) -> (s32[], f32[4,3,8192]) {{
  %tier = f32[4,3,8192]{{2,1,0:S(5)}} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,3,8192]{{2,1,0:S(5)}}) tuple(%zero, %tier)
  ROOT %while.0 = (s32[], f32[4,3,8192]{{2,1,0:S(5)}}) while(%init), condition=%body, body=%body
}}
'''


@pytest.mark.parametrize('waits', [True, False], ids=['write_back_waits', 'independent'])
def test_a_write_back_that_waits_for_the_next_fetch_is_not_full_duplex(waits):
  """Row 1's fetch is prefetched either way (it reads the tier as it was before row 0's
  write-back); only without the barrier can row 0's write-back and row 1's fetch be on
  the link at once."""
  schedule = Schedule.from_text(_duplex_module(waits))
  rows = schedule.streamed_rows
  assert [(r.fetch, r.write_back) for r in rows] == [
      ('fetch-start.0', 'wb-start.0'), ('fetch-start.1', 'wb-start.1')]
  assert schedule.stream_prefetched()
  assert [r.write_back_after_next_fetch for r in rows] == [waits, False]
  assert schedule.stream_full_duplex() is (not waits)
  assert schedule.summary()['streamed_write_backs_after_next_fetch'] == int(waits)


def test_device_updates_outside_the_host_call_are_counted():
  schedule = Schedule.from_text(_MODULE)
  [position] = schedule.device_updates()
  assert schedule.device_updates_outside_host_calls() == ()
  assert schedule.host_calls_started_before(position) == 1
  moved = Schedule.from_text(_MODULE.replace(
      '  %while.0 = (s32[], f32[2,3,1024]{2,1,0:S(5)}) while(%tuple.0), condition=%body, body=%body\n'
      '  %call-done = f32[4,3,1024]{2,1,0:S(5)} custom-call-done(%call-start)\n',
      '  %call-done = f32[4,3,1024]{2,1,0:S(5)} custom-call-done(%call-start)\n'
      '  %while.0 = (s32[], f32[2,3,1024]{2,1,0:S(5)}) while(%tuple.0), condition=%body, body=%body\n'))
  assert moved.device_updates_outside_host_calls() == moved.device_updates()
  assert moved.gemm_positions == schedule.gemm_positions
