"""Early host chunks (`Offload(early_chunks=K)`, `dos_jax.step.early_chunks`) compiled for an
H100, over a family of MLP shapes (`dos_jax.dataflow.probes.mlp_step`: one subgroup per
layer, Stride(2), `dos_jax.clip_by_global_norm(1.0)`, native host kernel, per-subgroup
storage). What the construction holds in every program:

* K host calls, chained (each done before the next starts: the device link);
* the early ones start while the backward pass still runs, before the last weight
  gradient has left for the host, with backward gemms inside their windows (the
  scheduler issues a host call's start as soon as its operands are ready; the rule is
  guarded in tests/test_compiled_host_chunks.py);
* the last call (the last chunk and the redo of the speculated ones) overlaps the device
  tiers' stream call, so no device update runs outside a host call;
* the early blocks' speculated params leave for the device as soon as their call is
  done; the redone ones are a result of the last call, crossing only on a rollback (a
  conditional), so no schedule can read them early;
* the stream is full duplex, and the state is never copied host to host (the undo is
  written by the kernel, not copied by XLA).

Compiled with the CUDA plugin's compile-only client; skipped where it is not installed.
"""

import pytest

from dos_jax import dataflow
from dos_jax.step import device_stream
from dos_jax.dataflow import probes
from tests import compiled

pytestmark = pytest.mark.compiled_gpu

compiled.skip_without_gpu_compiler()

# (layers, width, dtype, chunks): 2-8 host subgroups, 256-4096 wide, both dtypes
# (experiments/schedule_family.py --early-chunks 4 prints the whole family).
SHAPES = ((5, 4096, 'float32', 2), (7, 512, 'float32', 3), (8, 1024, 'bfloat16', 4),
          (16, 256, 'bfloat16', 4), (16, 1024, 'float32', 4))


@pytest.mark.parametrize('layers, width, dtype, chunks', SHAPES, ids=lambda v: str(v))
def test_early_host_chunks_start_during_the_backward_pass(layers, width, dtype, chunks):
  """Where this jax builds no stream region (`device_stream.available()` is False: jax
  0.12) the device update is the scheduler's to place; the rest holds the same."""
  fn, args, jit_kwargs = probes.mlp_step(layers, width, dtype=dtype, storage='per_subgroup',
                                         early_chunks=chunks)
  schedule = dataflow.compile_for_gpu(fn, *args, **jit_kwargs).schedule
  calls = schedule.host_calls
  assert len(calls) == chunks, calls
  assert all(a.done < b.start for a, b in zip(calls, calls[1:])), calls
  last_gemm = max(schedule.gemm_positions)
  assert schedule.host_calls_started_before(last_gemm) >= 1, (calls, last_gemm)
  assert any(c.start < g < c.done for c in calls[:-1] for g in schedule.gemm_positions), (
      calls, schedule.gemm_positions)
  last_copy = max(c.start for c in schedule.gradient_copies() if c.to_host)
  assert calls[0].start < last_copy, (calls[0], last_copy)
  if device_stream.available():
    (stream,) = schedule.stream_calls
    assert stream.updates and stream.overlaps(calls[-1]), (stream, calls[-1])
    assert not schedule.device_updates_outside_host_calls(), (calls, stream)
  assert schedule.stream_full_duplex(), schedule.streamed_rows
  assert not schedule.large_host_copies(), schedule.host_copies
