"""The thunk reader (`dataflow.thunks`) and the reading of stream lanes
(`dataflow.streamed_rows`), on texts written as XLA:GPU 0.11 prints them (excerpts of
the 5 x 512 fp32 MLP step of `tests.tooling.probes.mlp_step`, compiled for an H100 with
`xla_dump_to`). No plugin needed."""

import pytest

from dos_jax.dataflow import Schedule
from dos_jax.dataflow.thunks import Placement
from dos_jax.dataflow.thunks import ThunkProgram
from dos_jax.dataflow.thunks import parse_names

# One region on stream 1 (the device tiers as one stream region), an asynchronous
# gradient copy of its own on stream 3, a loop whose body fetches a row on stream 0,
# and the host call.
_SEQUENCE = '''\
001: kCustomKernel     [source        | next=002 (1) ] gemm_fusion_dot.4 grid: [64, 1, 1]
024: kAsyncStart       [prev=022 (1)  | next=088 (43)] stream=computation_stream[3], async_id=24
    023: kCopy [source | sink] (no description)
050: kAsyncDone        [source        | sink         ] async_id=24
074: kAsyncStart       [prev=069 (5)  | next=091 (4) ] stream=computation_stream[1], async_id=74
    075: kCopy         [source       | next=082 (7)] (no description)
    076: kCopy         [source       | next=083 (7)] (no description)
    082: kCustomKernel [prev=081 (1) | next=084 (2)] dos_jax_adamw_rows grid: [129, 1, 1]
    084: kCopy         [prev=082 (2) | sink        ] (no description)
    085: kCopy         [prev=083 (2) | sink        ] (no description)
088: kHostExecuteStart [prev=067 (8)  | next=089 (1) ] (no description)
089: kHostExecuteDone  [prev=088 (1)  | next=095 (6) ] (no description)
090: kAsyncDone        [source        | sink         ] async_id=74
098: kWhile            [prev=096 (2)  | next=133 (1) ]
condition:
    099: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1]
  body:
    104: kAsyncStart   [source        | next=111 (5) ] stream=computation_stream[0], async_id=104
        106: kDynamicSliceFusion [source | sink] params=1, results=1
            105: kCopy [source | sink] kCopy
    110: kAsyncDone    [source        | sink         ] async_id=104
    111: kCustomKernel [prev=108 (3)  | next=112 (1) ] dos_jax_adamw_rows grid: [129, 1, 1]
'''

_METADATA = '''\
thunk_metadata {
  thunk_info {
    profile_annotation: "command_buffer_1"
  }
  thunk_kind: "kCommandBuffer"
}
''' + ''.join(f'''thunk_metadata {{
  thunk_info {{
    profile_annotation: "{name}"
    thunk_id: {thunk_id}
  }}
  thunk_kind: "k"
}}
''' for thunk_id, name in [
    (1, 'gemm_fusion_dot.4'), (23, 'copy-start.7'), (24, 'copy-start.7'), (50, 'copy-done.7'),
    (74, 'call-start.1'), (75, 'copy-start.15'), (76, 'copy-start.2.0'),
    (82, 'pallas_call.9'), (84, 'copy-start.1.0'), (85, 'copy-start.3.0'),
    (88, 'host-call.1.call-start'), (89, 'host-call.1.call-done'), (90, 'call-done.1'),
    (98, 'while.1'), (99, 'loop_compare_fusion'), (104, 'dynamic-slice-start.2'),
    (105, 'dynamic-slice-start.2'), (106, 'dynamic-slice-start.2'),
    (110, 'dynamic-slice-done.2'), (111, 'pallas_call.3')])


def _program() -> ThunkProgram:
  return ThunkProgram.parse(_SEQUENCE, parse_names(_METADATA))


def test_metadata_names_each_thunk_and_skips_unnamed_ones():
  names = parse_names(_METADATA)
  assert names[74] == 'call-start.1' and names[105] == 'dynamic-slice-start.2'
  assert 'command_buffer_1' not in names.values()


def test_sequence_nests_a_region_and_a_loop_body():
  program = _program()
  assert [t.id for t in program.thunks] == [1, 24, 50, 74, 88, 89, 90, 98]
  (region,) = program.regions()
  assert (region.name, region.stream) == ('call-start.1', 1)
  assert [t.name for t in region.nested] == [
      'copy-start.15', 'copy-start.2.0', 'pallas_call.9', 'copy-start.1.0', 'copy-start.3.0']
  loop = program.thunks[-1]
  assert [t.id for t in loop.nested] == [99, 104, 110, 111]
  assert [t.id for t in loop.nested[1].nested] == [106]
  assert [t.id for t in loop.nested[1].nested[0].nested] == [105]


@pytest.mark.parametrize('name, placement', [
    ('copy-start.15', Placement(stream=1, region='call-start.1')),
    ('copy-start.3.0', Placement(stream=1, region='call-start.1')),
    ('copy-start.7', Placement(stream=3, region=None)),
    ('dynamic-slice-start.2', Placement(stream=0, region=None)),
    ('gemm_fusion_dot.4', Placement(stream=None, region=None)),
    ('pallas_call.3', Placement(stream=None, region=None)),
    ('nowhere', None),
])
def test_where_each_instruction_runs(name, placement):
  assert _program().runs_on(name) == placement


def test_copies_in_one_region_run_one_after_another_and_others_do_not():
  program = _program()
  assert program.one_after_another('copy-start.1.0', 'copy-start.2.0')
  assert not program.one_after_another('copy-start.1.0', 'copy-start.7')
  assert not program.one_after_another('copy-start.7', 'dynamic-slice-start.2')
  assert not program.one_after_another('copy-start.1.0', 'nowhere')


def _lanes_module(linked: bool) -> str:
  """Two stream calls in one scheduling group (streams 1 and 2), each streaming two
  per-subgroup rows (copy to the device, a Pallas kernel, copy back). With `linked`,
  the second call starts from what the first call's done returns."""
  second_input = '%gte.0' if linked else '%r1'

  def region(name: str) -> str:
    return f'''%{name} (a: f32[3,8192], b: f32[3,8192]) -> (f32[3,8192], f32[3,8192]) {{
  %a = f32[3,8192]{{1,0:S(5)}} parameter(0)
  %b = f32[3,8192]{{1,0:S(5)}} parameter(1)
  %f0 = (f32[3,8192]{{1,0}}, f32[3,8192]{{1,0:S(5)}}, u32[]) copy-start(%a)
  %d0 = f32[3,8192]{{1,0}} copy-done(%f0)
  %k0 = f32[3,8192]{{1,0}} custom-call(%d0), custom_call_target="__gpu$xla.gpu.triton"
  %w0 = (f32[3,8192]{{1,0:S(5)}}, f32[3,8192]{{1,0}}, u32[]) copy-start(%k0)
  %h0 = f32[3,8192]{{1,0:S(5)}} copy-done(%w0)
  %bar = (f32[3,8192]{{1,0:S(5)}}, f32[3,8192]{{1,0:S(5)}}) opt-barrier((f32[3,8192]{{1,0:S(5)}}, f32[3,8192]{{1,0:S(5)}}) %b, %h0)
  %b2 = f32[3,8192]{{1,0:S(5)}} get-tuple-element(%bar), index=0
  %f1 = (f32[3,8192]{{1,0}}, f32[3,8192]{{1,0:S(5)}}, u32[]) copy-start(%b2)
  %d1 = f32[3,8192]{{1,0}} copy-done(%f1)
  %k1 = f32[3,8192]{{1,0}} custom-call(%d1), custom_call_target="__gpu$xla.gpu.triton"
  %w1 = (f32[3,8192]{{1,0:S(5)}}, f32[3,8192]{{1,0}}, u32[]) copy-start(%k1)
  %h1 = f32[3,8192]{{1,0:S(5)}} copy-done(%w1)
  ROOT %t = (f32[3,8192]{{1,0:S(5)}}, f32[3,8192]{{1,0:S(5)}}) tuple(%h0, %h1)
}}

'''

  return f'''HloModule jit_lanes, is_scheduled=true

{region('lane0')}{region('lane1')}ENTRY %main (r0: f32[3,8192], r1: f32[3,8192], r2: f32[3,8192], r3: f32[3,8192]) -> f32[3,8192] {{
  %r0 = f32[3,8192]{{1,0:S(5)}} parameter(0)
  %r1 = f32[3,8192]{{1,0:S(5)}} parameter(1)
  %r2 = f32[3,8192]{{1,0:S(5)}} parameter(2)
  %r3 = f32[3,8192]{{1,0:S(5)}} parameter(3)
  %call-start.1 = ((f32[3,8192]{{1,0:S(5)}}, f32[3,8192]{{1,0:S(5)}}), (f32[3,8192]{{1,0:S(5)}}, f32[3,8192]{{1,0:S(5)}})) call-start(%r0, %r2), to_apply=%lane0, frontend_attributes={{_scheduling_group_id="7000",_xla_stream_annotation="1"}}
  %call-done.1 = (f32[3,8192]{{1,0:S(5)}}, f32[3,8192]{{1,0:S(5)}}) call-done(%call-start.1), frontend_attributes={{_scheduling_group_id="7000",_xla_stream_annotation="1"}}
  %gte.0 = f32[3,8192]{{1,0:S(5)}} get-tuple-element(%call-done.1), index=0
  %call-start.2 = ((f32[3,8192]{{1,0:S(5)}}, f32[3,8192]{{1,0:S(5)}}), (f32[3,8192]{{1,0:S(5)}}, f32[3,8192]{{1,0:S(5)}})) call-start({second_input}, %r3), to_apply=%lane1, frontend_attributes={{_scheduling_group_id="7000",_xla_stream_annotation="2"}}
  %call-done.2 = (f32[3,8192]{{1,0:S(5)}}, f32[3,8192]{{1,0:S(5)}}) call-done(%call-start.2), frontend_attributes={{_scheduling_group_id="7000",_xla_stream_annotation="2"}}
  ROOT %out = f32[3,8192]{{1,0:S(5)}} get-tuple-element(%call-done.2), index=1
}}
'''


def test_one_lane_alone_reads_each_row_after_the_one_before_it():
  """Within one lane's region each fetch follows the previous row's write-back (the
  barrier): read alone, that lane is not full duplex."""
  text = _lanes_module(linked=False).replace('_xla_stream_annotation="2"', 'x="2"')
  rows = Schedule.from_text(text).streamed_rows
  lane0 = [r for r in rows if r.computation == 'lane0']
  assert [r.after_previous_write_back for r in lane0] == [False, True]


@pytest.mark.parametrize('linked', [False, True], ids=['independent', 'linked'])
def test_stream_lanes_read_as_one_stream_row_by_row(linked):
  """Two lanes in one group are one stream, lane 0 holding rows 0 and 2, lane 1 rows 1
  and 3: each row's previous row is in the other lane, which it depends on only when
  one call starts from the other's done."""
  schedule = Schedule.from_text(_lanes_module(linked))
  rows = schedule.streamed_rows
  assert [(r.computation, r.fetch) for r in rows] == [
      ('lane0', 'f0'), ('lane1', 'f0'), ('lane0', 'f1'), ('lane1', 'f1')]
  assert {r.stream for r in rows} == {'lanes:7000'}
  assert [r.after_previous_write_back for r in rows] == [False, linked, False, linked]
  assert schedule.stream_full_duplex() is (not linked)
