"""One optimizer step: what `update` builds from the state's geometry (`dos_jax.geometry`).

* `transform` -- `offloaded()`: `init` and `update`, the one place a step asks which
  program it builds (`Program`), and the order of the tiers' updates in it;
* `tier_updates` -- one tier's update, block by block, on its path (`Path`, a `match`);
* `paths` -- the loops: the device-streamed rows, the host regions, the resident rows;
* `adamw_hyperparams` -- AdamW written once: its chain and the scalars the kernels read;
* `kernel_calls` -- the native host AdamW and the Pallas AdamW as the paths call them;
* `device_stream` -- a function as a call on a GPU stream of its own, in a scheduling
  group with host regions;
* `lanes` -- the device tiers in stream lanes beside the host tier, one call per lane
  (docs/design.md rules 1 and 3), per device for a state sharded shard-major;
* `construction` -- whether a state's step runs its halves on two streams;
* `early_calls` -- the host tier in host calls that start during the backward pass and
  speculate on the clip factor (`Partition.early`, rule 6).
"""
