"""`dos-jax train` and `dos-jax prepare`: placeholder until the runner lands."""


def register(subparsers) -> None:
  del subparsers
