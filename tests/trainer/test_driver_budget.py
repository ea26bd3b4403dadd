"""The driver's clock and cadence with a stand-in batch source: --max_wall_s stops at an iteration boundary (the
chunk cut to what fits the budget, one iteration first while the rate is unknown) and evaluates the final policy,
--max_train_s after that many seconds of training, --first_checkpoint_iteration saves early, a stop request
part-way through a chunk keeps the iterations that finished and saves the last of them (a stop with no whole
state of it saves none; a full disk then is one warning), a signal held while a chunk runs stops the run at the
next boundary, and every time counts from the run's start clock."""
import errno
import json
import os
import signal
import time

import pytest

from ebrl_jax import config as config_lib
from ebrl_jax.runtime import errors
from ebrl_jax.runtime import run_clock
from ebrl_jax.runtime import startup
from ebrl_jax.trainer import cadence
from ebrl_jax.trainer import checkpoint as checkpoint_lib
from ebrl_jax.trainer import driver

ITERATION_S = 0.2


def _trained(state):
  """`state` one train step on, as far as a checkpoint tells: its policy version and its observation count."""
  normalizer = state.params.normalizer
  params = state.params.replace(normalizer=normalizer.replace(count=normalizer.count + 1))
  return state.replace(policy_version=state.policy_version + 1, params=params)


class _Source:
  """Iterations of ITERATION_S each; records the size of every call. `stop_after`: raises a stop request (as the
  trainer's channel source does) once that many iterations are done."""

  def __init__(self, stop_after=None, signal_at=None, stop_at_eval=None, stale_stop=False, stop_reason='SIGINT'):
    self.calls, self.done, self.stop_after, self.signal_at = [], 0, stop_after, signal_at
    self.stop_reason = stop_reason
    self.evals, self.stop_at_eval, self.stale_stop = 0, stop_at_eval, stale_stop

  def compile(self, state, n):
    del state, n
    return 0.0

  def evaluate(self, params, key):
    del params, key
    self.evals += 1
    if self.evals == self.stop_at_eval:  # as the trainer's source does on a stop asked for meanwhile
      raise errors.StopRequested('stopped by the controller')
    return {'eval/episode_return': float(self.done)}

  def run_iterations(self, state, n):
    self.calls.append(n)
    before = state
    for i in range(n):
      if self.stop_after is not None and self.done >= self.stop_after:  # `stale_stop`: not this iteration's state
        raise errors.StopRequested(self.stop_reason, i, before if self.stale_stop else state, {})
      time.sleep(ITERATION_S)
      state = _trained(state)
      self.done += 1
      if self.done == self.signal_at:  # as a harness's time limit would, while the simulator's program runs
        os.kill(os.getpid(), signal.SIGTERM)
    return state, {}

  def close(self):
    pass


def _trainer(tmp_path, start=None, **schedule):
  schedule = {'num_timesteps': 40 * 20, 'num_evals': 10, 'checkpoint_every': 0, **schedule}
  cfg = config_lib.Config(sim=config_lib.SimConfig(num_envs=4, num_eval_envs=2, episode_length=50),
                          algo=config_lib.AlgoConfig(batch_size=4, num_minibatches=1, unroll_length=5),
                          schedule=config_lib.ScheduleConfig(run_dir=str(tmp_path), progress_bar=False, **schedule))
  return driver.trainer_config(cfg, startup.ProcessConfig(run_dir=str(tmp_path)), start)


def test_max_wall_s_stops_at_the_iteration_boundary_that_reaches_it(tmp_path):
  # 40 iterations of 0.2 s, 4 per evaluation; the budget (1.3 s from the compile: no start clock given). The first
  # chunk is one iteration (the rate is unknown), then chunks of half of what the rest holds: 3 (to the
  # evaluation at 4, 0.8 s), 2 (1.2 s), 1 (1.4 s: past the budget). The stop evaluates the policy it stopped at.
  source = _Source()
  summary = driver.run_training(_trainer(tmp_path, max_wall_s=1.3), lambda *args: source)
  assert summary.stopped == 'max_wall_s'
  assert source.calls[0] == 1 and all(1 <= n < 4 for n in source.calls[1:]) and len(source.calls) >= 3, source.calls
  # They shrink towards the budget: how fast depends on the machine's load (a loaded CI machine has ended on 2, not
  # 1), so only the direction is pinned, and the wall-clock bound below holds the stop within an iteration of it.
  assert source.calls[-1] <= source.calls[1], source.calls
  assert summary.iterations == sum(source.calls) and summary.env_steps == 20 * summary.iterations
  assert 1.3 <= summary.wall_s < 1.3 + ITERATION_S + 0.5
  assert [e['env_steps'] for e in summary.eval_curve] == [0, 80, summary.env_steps]  # the final one at the stop
  assert summary.final_eval_return == float(summary.iterations)  # the stand-in returns the iterations it ran


@pytest.mark.parametrize('reason', ['max_wall_s', 'SIGTERM'])
def test_a_budget_stop_the_source_reports_evaluates_the_final_policy_and_a_signal_does_not(tmp_path, reason):
  """Cells' ranks agree on --max_wall_s in their train step (`trainer.ranks`), so the stop comes up from the source
  part-way through a chunk: the budget's final evaluation follows its checkpoint, as for one run's budget."""
  source = _Source(stop_after=6, stop_reason=reason)
  summary = driver.run_training(_trainer(tmp_path, checkpoint_every=1), lambda *args: source)
  assert summary.stopped == reason and summary.iterations == 6 and summary.extra['last_checkpoint'] == 6
  steps = [e['env_steps'] for e in summary.eval_curve]
  assert steps == ([0, 80, 120] if reason == 'max_wall_s' else [0, 80])
  if reason == 'max_wall_s':
    assert summary.final_eval_return == 6.0  # the stand-in returns the iterations it ran


@pytest.mark.parametrize('resumed', [False, True], ids=['no_first_checkpoint', 'resumed'])
def test_max_wall_s_times_one_iteration_first_when_the_rate_is_unknown(tmp_path, resumed):
  """A run with no early checkpoint (--first_checkpoint_iteration=0), or a resumed one (its first checkpoint is on
  disk), knows no iteration rate at its first chunk: that chunk is one iteration, not the 4 to the next evaluation
  (0.8 s, past the 0.5 s budget), and the run stops within an iteration of the budget, with its final evaluation."""
  schedule = dict(checkpoint_every=1, first_checkpoint_iteration=0)
  if resumed:  # 8 iterations (4 per evaluation) and their checkpoints, then the same run resumed with a budget
    driver.run_training(_trainer(tmp_path, num_timesteps=8 * 20, num_evals=2, **schedule), lambda *args: _Source())
    schedule = dict(checkpoint_every=1, resume=True)
  source = _Source()
  summary = driver.run_training(_trainer(tmp_path, max_wall_s=0.5, **schedule), lambda *args: source)
  assert summary.stopped == 'max_wall_s' and source.calls[0] == 1, source.calls
  assert sum(source.calls) <= 3 and summary.iterations == (8 if resumed else 0) + sum(source.calls)  # 0.6 s at most
  assert summary.eval_curve[-1]['env_steps'] == summary.env_steps  # evaluated at the stop
  assert summary.extra['last_checkpoint'] == summary.iterations  # saved at the stop


def test_max_train_s_counts_training_seconds_only(tmp_path):
  # --max_train_s=1.0 at 0.2 s an iteration, the same 4 per evaluation: the first chunk is one iteration (to time
  # it), then chunks of half of what the rest holds, so the run stops at the first boundary past 1.0 s of training,
  # whatever start-up took (the 5 s the start clock says came before the driver are not counted).
  source = _Source()
  start = run_clock.StartClock(time.time() - 5.0)
  summary = driver.run_training(_trainer(tmp_path, start=start, max_train_s=1.0), lambda *args: source)
  assert summary.stopped == 'max_train_s' and source.calls[0] == 1, source.calls
  assert 1.0 <= summary.train_wall_s < 1.0 + 2 * ITERATION_S and summary.iterations == sum(source.calls)
  assert summary.wall_s >= 5.0 + summary.train_wall_s
  assert summary.eval_curve[-1]['env_steps'] == summary.env_steps  # the final policy's evaluation
  with pytest.raises(ValueError, match='max_train_s'):
    config_lib.ScheduleConfig(max_train_s=-1)


@pytest.mark.parametrize('now,want', [(0.8, 4), (1.6, 2), (2.0, 1), (2.19, 1), (2.5, 1)])
def test_budget_chunks_take_half_of_what_the_rest_of_the_budget_holds(tmp_path, now, want):
  """--max_wall_s=2.2 at 0.2 s an iteration, 20 iterations to the next evaluation: at 0.8 s the 1.4 s left hold 7
  iterations and the chunk is 4 (half, rounded up), so an iteration rate that falls mid-chunk (a busier machine)
  overshoots the budget by a fraction of what was left, not by all of it; at least one iteration, whatever is left.
  With the rate not known yet (a run's or a resumed run's first chunk), one iteration, to learn it."""
  schedule = _trainer(tmp_path, max_wall_s=2.2, num_evals=2).schedule
  progress = cadence.Progress(env_steps=0, iterations=0, last_saved=0, s_per_iteration=0.2)
  assert cadence.chunk_size(schedule, progress, 20, 40, now) == want
  unknown = cadence.Progress(env_steps=0, iterations=0, last_saved=0)
  assert cadence.chunk_size(schedule, unknown, 20, 40, now) == 1
  unlimited = _trainer(tmp_path, num_evals=2).schedule  # no budget: to the next evaluation
  assert cadence.chunk_size(unlimited, unknown, 20, 40, now) == 20


def test_first_checkpoint_comes_after_the_first_iteration(tmp_path):
  source = _Source()
  summary = driver.run_training(
      _trainer(tmp_path / 'cut', num_timesteps=8 * 20, num_evals=2, checkpoint_every=1, first_checkpoint_iteration=1),
      lambda *args: source)
  assert source.calls == [1, 3, 4] and summary.iterations == 8
  assert sorted(int(n) for n in os.listdir(tmp_path / 'cut' / 'checkpoints') if n.isdigit()) == [1, 4, 8]


def test_a_held_signal_stops_at_the_next_chunk_boundary_with_a_checkpoint(tmp_path, monkeypatch):
  """Signals held (`errors.deferred_stops`, one MJX process): SIGTERM during iteration 5 is not raised inside the
  chunk; the first chunk is one iteration (timed), the next ones fit STOP_LATENCY_S (0.5 s: 2 iterations of
  0.2 s), so the run stops after iteration 5, saves it, and names the signal. Outside the context SIGTERM is as it
  was."""
  monkeypatch.setattr(errors, 'STOP_LATENCY_S', 0.5)
  source = _Source(signal_at=5)
  before = signal.getsignal(signal.SIGTERM)
  with errors.deferred_stops():
    summary = driver.run_training(_trainer(tmp_path, num_evals=2, checkpoint_every=1), lambda *args: source)
    assert errors.pending_stop() == 'SIGTERM'
  assert signal.getsignal(signal.SIGTERM) is before and errors.pending_stop() == '' and not errors.stops_deferred()
  assert summary.stopped == 'SIGTERM' and summary.iterations == 5 == source.done
  assert source.calls == [1, 2, 2]
  assert max(int(n) for n in os.listdir(tmp_path / 'checkpoints') if n.isdigit()) == 5  # the stop's own


class _StopsEachIteration(_Source):
  """As native MuJoCo's fused loop (`fused_steps`): checks a held signal after every iteration itself."""
  stops_each_iteration = True

  def run_iterations(self, state, n):
    self.calls.append(n)
    for i in range(n):
      state, _ = super().run_iterations(state, 1)
      self.calls.pop()
      if errors.pending_stop():
        raise errors.StopRequested(errors.pending_stop(), i + 1, state, {})
    return state, {}


def test_a_source_that_stops_each_iteration_runs_whole_chunks_while_signals_are_held(tmp_path, monkeypatch):
  """Its chunks are not cut to STOP_LATENCY_S (0.5 s): after the timed first iteration, the 19 to the next
  evaluation in one call; SIGTERM during iteration 5 stops it there, saved and named."""
  monkeypatch.setattr(errors, 'STOP_LATENCY_S', 0.5)
  source = _StopsEachIteration(signal_at=5)
  with errors.deferred_stops():
    summary = driver.run_training(_trainer(tmp_path, num_evals=2, checkpoint_every=1), lambda *args: source)
  assert source.calls == [1, 19]
  assert summary.stopped == 'SIGTERM' and summary.iterations == 5 == source.done
  assert max(int(n) for n in os.listdir(tmp_path / 'checkpoints') if n.isdigit()) == 5


def test_deferred_stops_inactive_or_off_the_main_thread_change_nothing():
  before = signal.getsignal(signal.SIGTERM)
  with errors.deferred_stops(active=False):
    assert signal.getsignal(signal.SIGTERM) is before and not errors.stops_deferred()


def test_a_stop_request_mid_chunk_keeps_the_finished_iterations_and_the_clock_starts_at_process_start(tmp_path):
  source = _Source(stop_after=6)
  start = run_clock.StartClock(time.time() - 5.0, (('imports', 4.0), ('controller', 1.0)))  # 5 s before the driver
  summary = driver.run_training(_trainer(tmp_path, start=start), lambda *args: source)
  assert summary.stopped == 'SIGINT' and summary.iterations == 6 and summary.env_steps == 120
  assert summary.start_unix == pytest.approx(start.unix)
  assert summary.wall_s >= 5.0 + 6 * ITERATION_S
  first = summary.eval_curve[0]
  assert first['wall_s'] >= 5.0 and first['unix'] - first['wall_s'] == pytest.approx(start.unix, abs=0.05)
  # in line: each evaluation was asked for when its version was reached, and training waited for it
  assert all(5.0 <= e['reached_s'] <= e['wall_s'] for e in summary.eval_curve)
  assert [e['reached_s'] for e in summary.eval_curve] == sorted(e['reached_s'] for e in summary.eval_curve)
  with open(tmp_path / 'metrics.jsonl') as f:  # metrics.jsonl keeps the same clock as the summary
    evals = [r for r in map(json.loads, f) if 'eval/episode_return' in r]
  assert [r['wall_s'] for r in evals] == pytest.approx([e['wall_s'] for e in summary.eval_curve], abs=0.05)
  parts = summary.compile_breakdown
  assert parts['imports'] == 4.0 and parts['controller'] == 1.0 and parts['state_init'] > 0
  # each part is rounded to 1 ms in the summary: their sum is within half a millisecond a part of compile_s
  assert summary.compile_s == pytest.approx(sum(parts.values()), abs=5e-4 * len(parts) + 1e-6)
  assert summary.compile_s >= 5.0


def _steps(run_dir):
  return sorted(int(n) for n in os.listdir(run_dir / 'checkpoints') if n.isdigit())


def test_a_stop_request_saves_the_iteration_it_stopped_at_and_resume_continues_there(tmp_path):
  """4 iterations per evaluation, checkpoints at 1 and 4; the stop request after iteration 6 (the trainer's source,
  stopped at an iteration boundary) saves checkpoint 6, and --resume continues from iteration 6."""
  summary = driver.run_training(_trainer(tmp_path, checkpoint_every=1), lambda *args: _Source(stop_after=6))
  assert summary.stopped == 'SIGINT' and summary.iterations == 6 and summary.extra['last_checkpoint'] == 6
  assert _steps(tmp_path) == [1, 4, 6]
  source = _Source()
  resumed = driver.run_training(_trainer(tmp_path, checkpoint_every=1, resume=True, num_timesteps=8 * 20, num_evals=2),
                                lambda *args: source)
  assert resumed.extra['resumed_from']['step'] == 6 and resumed.extra['resumed_from']['iterations'] == 6
  assert source.calls == [2] and resumed.iterations == 8 and resumed.env_steps == 8 * 20
  assert resumed.stopped == 'num_timesteps' and _steps(tmp_path) == [4, 6, 8]


def test_a_stop_during_an_evaluation_saves_the_state_it_evaluated(tmp_path):
  """A stop the source sees while it evaluates iteration 4 (before that evaluation's checkpoint) saves the state of
  iteration 4: whole, since no train step has run since."""
  summary = driver.run_training(_trainer(tmp_path, checkpoint_every=1), lambda *args: _Source(stop_at_eval=2))
  assert summary.stopped == 'stopped by the controller' and summary.iterations == 4
  assert summary.extra['last_checkpoint'] == 4 and _steps(tmp_path) == [1, 4]


def test_a_stop_with_no_whole_state_of_its_iteration_saves_none(tmp_path, caplog):
  """A stop whose state is not that of the last iteration counted (a stop caught mid-update) is not saved: the
  newest checkpoint (4) stays, and the log says so."""
  source = _Source(stop_after=6, stale_stop=True)
  summary = driver.run_training(_trainer(tmp_path, checkpoint_every=1), lambda *args: source)
  assert summary.stopped == 'SIGINT' and summary.iterations == 6 and summary.extra['last_checkpoint'] == 4
  assert _steps(tmp_path) == [1, 4]
  assert 'stopping at iteration 6 without its checkpoint (no whole state of it to save)' in caplog.text
  assert f'Its checkpoint 4 in {tmp_path}/checkpoints stays loadable' in caplog.text


def test_a_full_disk_at_the_stops_checkpoint_is_one_warning_and_the_stop_goes_on(tmp_path, caplog, monkeypatch):
  """The stop's save finds the disk full (ENOSPC, as orbax passes it on): no exception, the summary of the stop,
  `last_checkpoint` the newest one that was written, one warning naming the full disk and that checkpoint."""
  save = checkpoint_lib.Checkpointer.save

  def full_at_six(self, step, state, extra=None):
    if step == 6:
      raise OSError(errno.ENOSPC, 'No space left on device', str(tmp_path / 'checkpoints' / '6.orbax-checkpoint-tmp'))
    return save(self, step, state, extra)

  monkeypatch.setattr(checkpoint_lib.Checkpointer, 'save', full_at_six)
  summary = driver.run_training(_trainer(tmp_path, checkpoint_every=1), lambda *args: _Source(stop_after=6))
  assert summary.stopped == 'SIGINT' and summary.iterations == 6 and summary.extra['last_checkpoint'] == 4
  warnings = [r.getMessage() for r in caplog.records if 'without its checkpoint' in r.getMessage()]
  assert len(warnings) == 1 and 'the save failed (the disk is full: No space left on device: ' in warnings[0], warnings
  assert f'Its checkpoint 4 in {tmp_path}/checkpoints stays loadable' in warnings[0]


def test_a_resumed_run_keeps_the_checkpoint_cadence_of_an_uninterrupted_one(tmp_path, monkeypatch):
  """--checkpoint_every=2 with an evaluation every 4 iterations saves at 8, 16, ..., 40. A run stopped at
  iteration 6 (between evaluations) and resumed saves at the same iterations: the cadence counts evaluation
  intervals from iteration 0, not the evaluations of a session (the resumed run's first is at 6)."""
  schedule, saves, save = dict(checkpoint_every=2, first_checkpoint_iteration=0), [], checkpoint_lib.Checkpointer.save

  def recorded(self, step, *args, **kwargs):
    saves.append(step)
    return save(self, step, *args, **kwargs)

  monkeypatch.setattr(checkpoint_lib.Checkpointer, 'save', recorded)
  driver.run_training(_trainer(tmp_path / 'whole', **schedule), lambda *args: _Source())
  assert saves == [8, 16, 24, 32, 40]
  saves.clear()
  stopped = driver.run_training(_trainer(tmp_path / 'cut', **schedule),
                                lambda *args: _Source(stop_after=6, stop_reason='SIGTERM'))
  assert stopped.stopped == 'SIGTERM' and saves == [6]
  resumed = driver.run_training(_trainer(tmp_path / 'cut', resume=True, **schedule), lambda *args: _Source())
  assert resumed.iterations == 40 and saves == [6, 8, 16, 24, 32, 40]
