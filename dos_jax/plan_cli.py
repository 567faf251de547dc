"""`dos-jax plan`: placeholder until the cost model lands."""


def register(subparsers) -> None:
  del subparsers
