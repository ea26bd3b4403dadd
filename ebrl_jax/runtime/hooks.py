"""`sys.unraisablehook` for the length of a block, without dropping a hook installed inside it.

A block that saves the hook, installs its own and puts the saved one back at its end also throws away every hook
installed meanwhile that chains to its own: the controller's stop-signal block (lifecycle) ended after the run's
MetricsLogger had installed its tensorboardX quieting, so tensorboardX's exit-time flush on a full disk printed its
traceback after the run's FATAL line. Here the block's hook is put back only while it is still the one installed;
otherwise it stays in the chain, passing everything on to the hook it found.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

Hook = Callable[[object], None]


class ScopedHook:
  """The hook a block installs (`unraisable_hook_within`): `wrap(previous)` while on, `previous` after."""

  def __init__(self, wrap: Callable[[Hook], Hook], previous: Hook):
    self.previous, self._inner, self.on, self.kept = previous, wrap(previous), True, False

  def __call__(self, unraisable) -> None:
    (self._inner if self.on else self.previous)(unraisable)

  def keep(self) -> None:
    """Stays on after the block (its late reports come until the process ends)."""
    self.kept = True


@contextlib.contextmanager
def unraisable_hook_within(wrap: Callable[[Hook], Hook], **attributes) -> Iterator[ScopedHook]:
  """Installs `wrap(sys.unraisablehook)` for the block (the ScopedHook carries `attributes`). At the end, unless
  kept: the hook found is put back if this one is still installed, else this one turns into a pass-through."""
  hook = ScopedHook(wrap, sys.unraisablehook)
  for name, value in attributes.items():
    setattr(hook, name, value)
  sys.unraisablehook = hook
  try:
    yield hook
  finally:
    if not hook.kept:
      hook.on = False
      if sys.unraisablehook is hook:
        sys.unraisablehook = hook.previous
