"""How XLA:GPU turns host regions into host calls, and where it schedules them.

An early, chunked host update (a host call per chunk of subgroups, each started when
its gradients are in host memory) relies on behaviour of XLA's host-offload passes and
latency-hiding scheduler that no API promises: read in XLA's sources
(`FindAndWrapOffloadedComputations`, `host_execute_thunk.cc`) and shown on programs
compiled for an H100 (`experiments/host_chunks_probe.py`, RESULTS.md). These tests fail
loudly where a JAX/XLA upgrade changes it:

* host regions sharing no value become **one** host call (XLA regroups host
  instructions; a disconnected one joins the current call);
* regions linked through a device op (each returns a token in device memory, computed
  from all of its outputs; a device op turns it into the next region's input, which
  every output of that region reads) stay **separate** calls, and the early ones start
  while the backward pass still runs, with backward gemms inside their windows (the
  scheduler issues a host call's start as soon as its operands are ready and its done
  late).

Compiled with the CUDA plugin's compile-only client; skipped where it is not installed.
"""

import pytest

from dos_jax import dataflow
from tests.tooling import probes
from tests import compiled

pytestmark = pytest.mark.compiled_gpu

compiled.skip_without_gpu_compiler()


def _schedule(chunks: int, link: probes.Link, layers: int = 6):
  fn, args, jit_kwargs = probes.host_chunks_program(chunks, link, num_layers=layers)
  return dataflow.compile_for_gpu(fn, *args, **jit_kwargs).schedule


def test_host_regions_that_share_no_value_become_one_host_call():
  schedule = _schedule(3, probes.Link.NONE)
  assert len(schedule.host_calls) == 1, schedule.host_calls
  assert schedule.host_calls_started_before(max(schedule.gemm_positions)) == 0


@pytest.mark.parametrize('chunks', [3, 6])
def test_device_linked_host_regions_stay_apart_and_start_during_the_backward_pass(chunks):
  schedule = _schedule(chunks, probes.Link.DEVICE)
  calls = schedule.host_calls
  assert len(calls) == chunks, calls
  # Chained: each call starts after the previous one is done.
  assert all(a.done < b.start for a, b in zip(calls, calls[1:])), calls
  last_gemm = max(schedule.gemm_positions)
  assert schedule.host_calls_started_before(last_gemm) >= chunks - 1, (calls, last_gemm)
  inside = sum(c.start < g < c.done for c in calls for g in schedule.gemm_positions)
  assert inside >= 2, (calls, schedule.gemm_positions)
