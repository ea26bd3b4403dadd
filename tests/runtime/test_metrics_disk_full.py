"""tensorboardX on a full disk: its writer thread's and exit hook's errors become one line; others pass through."""
import errno
import sys
import threading

from ebrl_jax.runtime import metrics


def _raised_in(filename, exc):
  """An exception whose traceback has a frame from `filename` (as if tensorboardX's code raised it)."""
  namespace = {'exc': exc}
  exec(compile('def writer():\n  raise exc\n', filename, 'exec'), namespace)  # pylint: disable=exec-used
  try:
    namespace['writer']()
  except OSError as e:
    return e


def test_tensorboard_disk_full_errors_become_one_line(monkeypatch, capsys):
  seen = []
  monkeypatch.setattr(threading, 'excepthook', lambda args: seen.append(('thread', args.exc_value)))
  monkeypatch.setattr(sys, 'unraisablehook', lambda u: seen.append(('unraisable', u.exc_value)))
  monkeypatch.setattr(metrics, '_TENSORBOARD_DISK', {'full': False, 'said': False})
  metrics.quiet_tensorboard_on_a_full_disk()
  metrics.quiet_tensorboard_on_a_full_disk()  # installed once
  tb_file = '/site-packages/tensorboardX/record_writer.py'
  ours = _raised_in('/work/ebrl_jax/x.py', OSError(errno.ENOSPC, 'No space left on device'))
  before = _raised_in(tb_file, OSError('handle is closed'))  # not after a full disk: not ours to hide

  def thread_args(e):
    return threading.ExceptHookArgs((type(e), e, e.__traceback__, None))

  threading.excepthook(thread_args(before))
  threading.excepthook(thread_args(ours))
  full = _raised_in(tb_file, OSError(errno.ENOSPC, 'No space left on device'))
  threading.excepthook(thread_args(full))
  threading.excepthook(thread_args(_raised_in(tb_file, OSError('handle is closed'))))  # what follows it

  class _Unraisable:
    exc_value = full
    exc_traceback = full.__traceback__

  sys.unraisablehook(_Unraisable())
  assert seen == [('thread', before), ('thread', ours)]
  assert capsys.readouterr().err.count('TensorBoard events: the disk is full') == 1


def test_a_writer_that_dies_between_two_scalars_of_one_record_stops_the_run_instead_of_blocking(tmp_path, monkeypatch):
  """The fault suite's full-disk trial caught a trainer blocked for good in tensorboardX's queue: its writer thread
  died while one record's scalars were being added. Every scalar now asks first; the run stops naming the disk."""
  monkeypatch.setattr(metrics, '_TENSORBOARD_DISK', {'full': False, 'said': False})

  class DyingWriter:  # stands in for tensorboardX's SummaryWriter: its writer thread dies at the second event
    logdir = str(tmp_path / 'tb')
    calls = 0

    def add_scalar(self, *args, **kwargs):
      del args, kwargs
      self.calls += 1
      if self.calls == 2:
        metrics._TENSORBOARD_DISK['full'] = True  # pylint: disable=protected-access
      assert self.calls <= 2, 'an event after the writer died: the real queue would block here for good'

  logger = metrics.MetricsLogger(str(tmp_path), 100, progress_bar=False)
  writer = DyingWriter()
  logger._tb = writer  # pylint: disable=protected-access
  try:
    logger.log(10, {'a': 1.0, 'b': 2.0, 'c': 3.0, 'd': 4.0}, echo=False)
    raise AssertionError('no error')
  except OSError as e:
    assert e.errno == errno.ENOSPC and e.filename == writer.logdir
  assert writer.calls == 2
  logger._tb = None  # pylint: disable=protected-access
  logger.close()
