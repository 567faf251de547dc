"""Verification tooling the tests share, outside the installed package: the def-use graph
of a lowered program (`graph`) and its MLIR ops (`ops`)."""
