"""The progress bar's postfix: an evaluation return still pending (None: the evaluator process has not answered,
as at the first iterations of `sync`/`async`/`overlap`) is left off instead of stopping the trainer (it raised a
TypeError in the trainer worker whenever the bar was on, the default)."""
import io

import tqdm

from ebrl_jax.runtime import metrics


def test_a_pending_evaluation_return_is_left_off_the_bar(tmp_path):
  logger = metrics.MetricsLogger(str(tmp_path), 1000, progress_bar=True)
  # The logger's bar is off where stderr is not a terminal (pytest): an enabled one writing to a buffer instead.
  logger._bar = tqdm.tqdm(total=1000, file=io.StringIO(), disable=False)  # pylint: disable=protected-access
  try:
    logger.advance(100, {'return': None, 'steps/s': 1234.5})
    assert logger._bar.n == 100  # pylint: disable=protected-access
    assert logger._bar.postfix == 'steps/s=1234'  # pylint: disable=protected-access
    logger.advance(200, {'return': 41.5, 'steps/s': 1000.0})
    assert logger._bar.n == 200  # pylint: disable=protected-access
    assert logger._bar.postfix == 'return=41.5, steps/s=1000'  # pylint: disable=protected-access
  finally:
    logger.close()
