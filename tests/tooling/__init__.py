"""Verification tooling the tests and `experiments/` share, outside the installed package:
the runner's step built and compiled for a GPU target without one (`gpu_program`), the
programs the compiled-schedule tests check beyond the runner's presets (`probes`), and the
def-use graph of a lowered program (`graph`) and its MLIR ops (`ops`). An experiment puts
the repository's root on `sys.path` to import it."""
