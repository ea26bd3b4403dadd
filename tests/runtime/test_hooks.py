"""A block's `sys.unraisablehook` (runtime/hooks.py) comes out at the block's end without dropping a hook that
was installed inside the block: the controller's stop-signal block dropped the MetricsLogger's tensorboardX
quieting that way, and tensorboardX's exit-time flush on a full disk printed its traceback after the FATAL line
(tests/test_disk_full.py, opt-in, shows that end to end)."""
import sys
import types

from ebrl_jax.runtime import hooks
from ebrl_jax.runtime import lifecycle


def _report(name):
  return types.SimpleNamespace(exc_type=RuntimeError, exc_value=RuntimeError(name), exc_traceback=None)


def test_a_hook_installed_inside_the_block_stays_and_the_blocks_own_passes_through_after(monkeypatch):
  seen = []
  monkeypatch.setattr(sys, 'unraisablehook', lambda u: seen.append(('base', str(u.exc_value))))

  def block_hook(previous):
    return lambda u: seen.append(('block', str(u.exc_value)))  # swallows everything while on

  with hooks.unraisable_hook_within(block_hook):
    outer = sys.unraisablehook
    sys.unraisablehook = lambda u: (seen.append(('inner', str(u.exc_value))), outer(u))  # chains, as metrics does
    inner = sys.unraisablehook
    inner(_report('during'))
  assert sys.unraisablehook is inner  # before the fix: the base hook was put back, the inner one lost
  sys.unraisablehook(_report('after'))
  assert seen == [('inner', 'during'), ('block', 'during'), ('inner', 'after'), ('base', 'after')]


def test_the_found_hook_is_put_back_where_nothing_was_installed_inside_unless_kept(monkeypatch):
  base = lambda u: None
  monkeypatch.setattr(sys, 'unraisablehook', base)
  with hooks.unraisable_hook_within(lambda previous: previous):
    assert sys.unraisablehook is not base
  assert sys.unraisablehook is base
  with hooks.unraisable_hook_within(lambda previous: previous) as hook:
    hook.keep()
  assert sys.unraisablehook is hook and hook.on


def test_the_stop_signal_block_leaves_a_hook_installed_inside_it(monkeypatch):
  base = lambda u: None
  monkeypatch.setattr(sys, 'unraisablehook', base)
  with lifecycle.stop_signals_as_interrupt():
    assert getattr(sys.unraisablehook, 'redelivers', False)
    with lifecycle.stop_signals_as_interrupt():  # nested: no second redelivering hook
      assert sys.unraisablehook.previous is base
    mine = sys.unraisablehook = (lambda outer: lambda u: outer(u))(sys.unraisablehook)
  assert sys.unraisablehook is mine
  with lifecycle.stop_signals_as_interrupt():  # the old one is off now: a new one goes on top
    assert sys.unraisablehook.previous is mine and sys.unraisablehook.on
  assert sys.unraisablehook is mine
