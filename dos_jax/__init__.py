"""dos_jax: Deep Optimizer States for JAX.

Optax transforms whose optimizer state lives in host memory, split into subgroups
that are updated partly on the device (streamed through free device memory) and
partly on the host, in one jitted step.
"""

from dos_jax.alias import adamw as adamw
from dos_jax.planner.auto import Auto as Auto
from dos_jax.planner.hardware import HardwareProfile as HardwareProfile
from dos_jax.planner.report import StepRecord as StepRecord
from dos_jax.planner.report import explain as explain
from dos_jax.alias import chain as chain
from dos_jax.cache import cache_dir as cache_dir
from dos_jax.clipping import clip_by_global_norm as clip_by_global_norm
from dos_jax.clipping import clip_factor as clip_factor
from dos_jax.clipping import is_offloaded as is_offloaded
from dos_jax.compiler_options import GPU_COMPILER_OPTIONS as GPU_COMPILER_OPTIONS
from dos_jax.compiler_options import PARALLEL_ASYNC_COMPUTE_LIMIT as PARALLEL_ASYNC_COMPUTE_LIMIT
from dos_jax.compiler_options import compiled_limit as compiled_limit
from dos_jax.compiler_options import compiled_with as compiled_with
from dos_jax.compiler_options import for_platform as compiler_options_for
from dos_jax.compiler_options import jit as jit
from dos_jax.host_memory import keep_freed_host_memory as keep_freed_host_memory
from dos_jax.implementation import Implementation as Implementation
from dos_jax.implementation import Program as Program
from dos_jax.implementation import UpdateImpl as UpdateImpl
from dos_jax.migration import migrate as migrate
from dos_jax.offload import Disk as Disk
from dos_jax.offload import Offload as Offload
from dos_jax.pinned_pool import check_pinned_pool as check_pinned_pool
from dos_jax.pinned_pool import PinnedPoolError as PinnedPoolError
from dos_jax.pinned_pool import size_pinned_pool as size_pinned_pool
from dos_jax.portable import pytree_targets as pytree_targets
from dos_jax.portable import state_from_pytrees as state_from_pytrees
from dos_jax.portable import state_to_pytrees as state_to_pytrees
from dos_jax.policies import AdaptivePolicy as AdaptivePolicy
from dos_jax.policies import AllDevice as AllDevice
from dos_jax.policies import AllHost as AllHost
from dos_jax.policies import DeviceFraction as DeviceFraction
from dos_jax.policies import Plan as Plan
from dos_jax.policies import Policy as Policy
from dos_jax.policies import Resident as Resident
from dos_jax.policies import ResidentFraction as ResidentFraction
from dos_jax.policies import Stride as Stride
from dos_jax.policies import SubgroupSpec as SubgroupSpec
from dos_jax.state_files import files_packing_mismatch as files_packing_mismatch
from dos_jax.state_files import has_disk_tier as has_disk_tier
from dos_jax.state_files import restoring_state as restoring_state
from dos_jax.state_files import state_files_tree as state_files_tree
from dos_jax.state_files import state_from_files as state_from_files
from dos_jax.state_files import state_to_files as state_to_files
from dos_jax.state_ops import abstract_state as abstract_state
from dos_jax.state_ops import reset_moments as reset_moments
from dos_jax.step.transform import OffloadedState as OffloadedState
from dos_jax.step.transform import offloaded as offloaded
from dos_jax.step.construction import stream_regions as stream_regions

__version__ = '0.1.0'

