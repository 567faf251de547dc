"""One optimizer step: what `update` builds from the state's geometry (`dos_jax.geometry`).

* `transform` -- `offloaded()`: `init` and `update`, the one place a step asks which
  program it builds (`Program`), and the order of the tiers' updates in it;
* `tier_updates` -- one tier's update, block by block, on its path (`Path`, a `match`);
* `paths` -- the loops: the device-streamed rows, the host regions, the resident rows,
  and the memory kinds every other module names;
* `fused` -- the native host AdamW and the Pallas AdamW as the paths call them;
* `device_stream` -- the device tiers as calls on GPU streams (one per lane), grouped
  with the host call (docs/design.md rules 1 and 3);
* `chunked` -- host and device tiers in K linked chunks, interleaved (`Offload.chunks`);
* `early_chunks` -- host calls during the backward pass that speculate on the clip
  factor (`Offload.early_chunks`, rule 6).
"""
