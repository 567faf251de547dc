"""The optimizer state's geometry: how a parameter tree becomes the offloaded state.

One concept in five modules, each with one job:

* `layout` -- a parameter tree <-> `(G, S)` subgroup rows: the packing order, the
  weight-decayed block, the padding, and (ZeRO-3) the shard-major packing;
* `slots` -- one tier block's `(R, K, S)` storage: which of the K rows holds the master,
  the first and the second moment;
* `partition` -- the tiers (host, streamed, resident) a plan puts the subgroups in, their
  blocks (stacked or per subgroup) and each leaf's pieces in them;
* `state` -- `OffloadedState`, the pytree the optimizer returns, and how optax, flax and
  orbax tools see it;
* `disk_files` -- the disk tier's files: their names, and reading and writing their rows.

The step (`dos_jax.step.transform` and the paths it dispatches to) reads and writes the state
through these; nothing here builds a step.
"""
