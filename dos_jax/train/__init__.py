"""The pretraining runner: config, model, data, mesh, step, checkpoints, CLI."""
