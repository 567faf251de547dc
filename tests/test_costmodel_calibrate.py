"""Calibration on this machine: small sizes, a real (if short) measurement, a valid profile."""

import math

import jax
import pytest

from dos_jax.planner import calibrate
from dos_jax.planner.costmodel import HardwareProfile


def _valid(profile: HardwareProfile):
  numbers = [
      profile.h2d_gbps, profile.d2h_gbps, profile.both_gbps, profile.device_adamw_gparams,
      profile.device_free_bytes, profile.host_copy_slowdown, profile.device_copy_gbps,
      *profile.host_adamw_gparams_by_threads.values(),
  ]
  assert all(math.isfinite(x) and x > 0 for x in numbers), profile
  assert profile.host_copy_slowdown >= 1
  assert profile.device_is_host == (jax.default_backend() == 'cpu')
  assert 'calibrate' in profile.source


def test_calibrate_small_yields_a_valid_profile_that_round_trips(tmp_path):
  profile = calibrate.calibrate(0.5, sizes=(1 << 14, 1 << 16))
  _valid(profile)
  path = tmp_path / 'p.json'
  profile.to_json(path)
  assert calibrate.load_profile(path) == profile


def test_cached_profile_measures_once(tmp_path, monkeypatch):
  monkeypatch.setenv(calibrate.CACHE_DIR_ENV, str(tmp_path))
  path = calibrate.profile_path()
  assert path.startswith(str(tmp_path)) and jax.default_backend() in path
  first = calibrate.cached_profile(seconds_budget=0.3, sizes=(1 << 14,))
  _valid(first)
  assert calibrate.load_profile(path) == first
  # A second call reads the cache (a fresh calibration would differ in its timestamp).
  assert calibrate.cached_profile(seconds_budget=0.3, sizes=(1 << 14,)) == first
  again = calibrate.cached_profile(refresh=True, seconds_budget=0.3, sizes=(1 << 14,))
  _valid(again)


@pytest.mark.gpu
def test_calibrate_on_gpu_sees_pcie_and_hbm():
  profile = calibrate.calibrate(2.0, sizes=(1 << 24,))
  _valid(profile)
  assert not profile.device_is_host
  # PCIe is far slower than HBM: the device update must beat the link by a wide margin.
  assert profile.device_adamw_gparams * 12 > 3 * profile.h2d_gbps
  assert 1 < profile.h2d_gbps < 1000 and profile.device_free_bytes > 1e9
