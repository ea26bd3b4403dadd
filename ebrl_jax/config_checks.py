"""Validation helpers shared by the config dataclasses: each error is a `ValueError` naming the field as its flag
and what is allowed."""
from __future__ import annotations


def check_choice(field: str, value, allowed) -> None:
  if value not in allowed:
    raise ValueError(f'--{field}={value!r} is not valid; allowed values: {", ".join(map(str, allowed))}.')


def check_positive(field: str, value, allow_zero: bool = False) -> None:
  ok = value >= 0 if allow_zero else value > 0
  if not ok:
    bound = '>= 0' if allow_zero else '> 0'
    raise ValueError(f'--{field}={value!r} must be {bound}.')


def check_range(field: str, value: float, lo: float, hi: float) -> None:
  if not lo <= value <= hi:
    raise ValueError(f'--{field}={value!r} must lie in [{lo}, {hi}].')
