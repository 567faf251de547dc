"""What one training step reports to the loop: `StepResult`.

Its own module so that both trainers (`trainer.Trainer`, `pipeline_run.PipelineTrainer`)
return it without importing each other.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StepResult:
  """Host-side results of one step.

  Attributes:
    loss: training loss of the batch (before the update).
    grad_norm: global L2 norm of the gradients before clipping.
    step_s: wall time of the whole step.
    grad_s: wall time of forward + backward + norm (split steps only, else None).
    update_s: wall time of the optimizer update, the phase dos_jax offloads (split
      steps only, else None: a fused step has no separate update phase).
    compiled: the step compiled a program (its times include compiling).
    migrate_s: wall time of moving the state's rows to the step's plan before it
      (`dos_jax.migrate`), 0 when the plan did not change; not part of `step_s`.
  """

  loss: float
  grad_norm: float
  step_s: float
  grad_s: float | None = None
  update_s: float | None = None
  compiled: bool = False
  migrate_s: float = 0.0

  @property
  def split(self) -> bool:
    """Whether the step ran as two programs (and so has an update time)."""
    return self.update_s is not None
