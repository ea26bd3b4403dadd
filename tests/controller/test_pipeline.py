"""The process schedules: sync equals fused, async learns, worker faults, Ctrl-C and resume."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import runs_testlib  # pylint: disable=g-bad-import-order

from ebrl_jax import config as config_lib
from ebrl_jax import controller
from ebrl_jax.runtime import lifecycle

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKES = os.path.join(ROOT, 'tests', 'fakes')  # stand-ins for nvidia-cuda-mps-control and pynvml


def _config(run_dir, schedule='sync', transport='thread', num_groups=1, **schedule_kw):
  schedule_kw = {'num_timesteps': 25_600, 'num_evals': 2, **schedule_kw}
  return config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum',
                                                    num_envs=32,
                                                    num_eval_envs=8,
                                                    num_threads=1),
                           algo=config_lib.AlgoConfig(batch_size=32, num_minibatches=8),
                           schedule=config_lib.ScheduleConfig(name=schedule,
                                                              run_dir=str(run_dir),
                                                              compilation_cache_dir='',
                                                              progress_bar=False,
                                                              transport=transport,
                                                              num_groups=num_groups,
                                                              **schedule_kw))


def test_sync_with_one_group_replays_fused_exactly(tmp_path):
  """Same seed, same keys, same env resets: the eval curves agree to the last bit (float equality)."""
  fused = controller.run(_config(tmp_path / 'fused', schedule='fused'))
  sync = controller.run(_config(tmp_path / 'sync', schedule='sync', transport='thread'))
  assert [e['return'] for e in sync.eval_curve] == [e['return'] for e in fused.eval_curve]
  runs_testlib.assert_each_segment_once(sync, 25_600, 20)
  assert fused.env_steps == 25_600


def test_sync_with_one_group_replays_fused_exactly_on_mjx(tmp_path):
  """MJX too (slow: MJX compiles for minutes on a CPU): the fused program (collection and training in one jitted
  scan) and `sync` with one group (a rollout worker's collect program, the trainer's train step) draw the same
  keys (`rollout.keys`) and reset the same envs; their evaluations and final parameters agree to the last bit."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from ebrl_jax import sim  # pylint: disable=g-import-not-at-top
  from ebrl_jax.generation import policies  # pylint: disable=g-import-not-at-top
  from ebrl_jax.trainer import checkpoint, stages  # pylint: disable=g-import-not-at-top

  def run(schedule):
    cfg = runs_testlib.tiny_mjx_config(tmp_path / schedule, name=schedule, num_groups=1, num_timesteps=320, num_evals=2)
    return cfg, controller.run(cfg)

  (cfg, fused), (_, sync) = run('fused'), run('sync')
  assert [e['return'] for e in sync.eval_curve] == [e['return'] for e in fused.eval_curve]
  runs_testlib.assert_each_segment_once(sync, 320, 4)
  assert fused.env_steps == 320
  spec = sim.env_spec('inverted_pendulum', 40, 1)
  network = policies.make_network(cfg.policy, spec.obs_dim, spec.action_dim)
  template = stages.init_train_state(network, stages.make_optimizer(cfg.algo), jax.random.PRNGKey(0), spec.obs_dim)
  final = []
  for schedule in ('fused', 'sync'):
    with checkpoint.Checkpointer(str(tmp_path / schedule / 'checkpoints')) as ckpt:
      state, _, step = ckpt.restore(template)
    assert step == 4
    final.append(jax.device_get(state.params))
  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), *final)
  assert all(jax.tree_util.tree_leaves(same)), same


def test_async_processes_learn_with_bounded_staleness_and_trace_every_process(tmp_path):
  trace_dir = tmp_path / 'trace'
  cfg = _config(tmp_path / 'async',
                schedule='async',
                transport='shm',
                num_groups=2,
                max_staleness=1,
                trace_dir=str(trace_dir))
  summary = controller.run(cfg)
  # 20 iterations x 2 groups; every record unique; nothing older than the bound was trained on.
  extra = runs_testlib.assert_each_segment_once(summary, 25_600, 40, max_staleness=1)
  assert summary.best_eval_return > 2 * summary.eval_curve[0]['return']
  # Each process reported its start-up steps, and its last one is its steady work.
  phases = {name: r['phase'] for name, r in lifecycle.read_phases(cfg.schedule.run_dir).items()}
  assert phases == {
      'trainer': 'training',
      'rollout/0': 'collecting',
      'rollout/1': 'collecting',
      'evaluator': 'evaluating'
  }
  # The evaluator process (the default --evaluator) scored every version asked for, the final one included: the
  # curve is keyed by version and env steps, in order (10 iterations per evaluation, 1,280 env steps each).
  assert [(e['version'], e['env_steps']) for e in summary.eval_curve] == [(0, 0), (10, 12_800), (20, 25_600)]
  assert extra['evaluator']['evaluations'] == 3 and extra['evaluator']['missing'] == 0
  _assert_timeline_of_every_process(json.load(open(trace_dir / 'trace.json'))['traceEvents'], summary)


def _assert_timeline_of_every_process(events, summary):
  """--trace_dir's timeline: a track per process, the controller's telemetry counters, each stage's spans."""
  names = {e['args']['name'] for e in events if e.get('ph') == 'M'}
  assert names == {'trainer', 'rollout/0', 'rollout/1', 'evaluator', 'telemetry'}
  # The controller's telemetry adds counter tracks: CPU use of every worker (no GPU here).
  counters = {e['name'] for e in events if e.get('ph') == 'C'}
  assert {'cpu_pct/trainer', 'cpu_pct/rollout/0', 'cpu_pct/rollout/1'} <= counters
  assert summary.extra['telemetry']['cpu_pct/trainer'] > 0
  spans = {e['name'] for e in events if e.get('ph') == 'X'}
  assert {'gen/act', 'sim/step', 'rollout/collect', 'train/train_step', 'train/wait_segments'} <= spans
  assert 'evaluator/evaluate' in spans and 'train/evaluate' not in spans  # the evaluator process evaluated
  assert all(e['dur'] >= 0 for e in events if e.get('ph') == 'X')
  # 20 iterations were trained, each one train_step span.
  assert summary.extra['stage_ms']['train/train_step']['count'] == 20


def _launch(run_dir, *flags, env=None):
  env = dict(os.environ, JAX_PLATFORMS='cpu', **(env or {}))
  return subprocess.Popen([
      sys.executable, '-m', 'ebrl_jax.main', '--task=inverted_pendulum', '--num_envs=32', '--batch_size=32',
      '--num_minibatches=8', '--num_eval_envs=8', '--num_threads=1', '--compilation_cache_dir=', '--noprogress_bar',
      f'--run_dir={run_dir}', *flags
  ],
                          cwd=ROOT,
                          env=env,
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True)


def _assert_workers_gone(workers):
  """Every worker named in workers.json exits within 10 s, and no shared-memory segment of the controller stays."""
  pids = list(workers['workers'].values())
  deadline = time.monotonic() + 10
  while any(lifecycle.pid_alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.2)
  assert not [p for p in pids if lifecycle.pid_alive(p)]
  assert not _our_segments(workers['controller'])


def _wait_for(predicate, timeout, proc):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    if proc.poll() is not None:
      raise AssertionError(f'run ended early:\n{proc.stdout.read()[-3000:]}')
    time.sleep(0.2)
  return False


def _trained_iterations(run_dir):
  path = os.path.join(run_dir, 'metrics.jsonl')
  if not os.path.exists(path):
    return 0
  return sum('train/ppo/total_loss' in line for line in open(path))


def _our_segments(controller_pid):
  return [n for n in os.listdir('/dev/shm') if n.startswith(f'ebrl_{controller_pid}_')]


@pytest.mark.parametrize(
    'role,flags',
    [
        ('rollout/0', ()),
        ('generation', ('--nocolocate_generation',)),  # sim, generation and training in three kinds of process
    ],
    ids=['rollout_worker', 'generation_worker'])
def test_killed_worker_is_restarted_without_losing_or_duplicating_segments(tmp_path, role, flags):
  run_dir = tmp_path / 'fault'
  proc = _launch(run_dir, '--schedule=async', '--num_groups=2', '--num_timesteps=38400', '--num_evals=6', *flags)
  try:
    assert _wait_for(lambda: _trained_iterations(run_dir) >= 1, 240, proc)
    workers = json.load(open(run_dir / 'workers.json'))
    victim = workers['workers'][role]
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 0, out[-3000:]
  assert '%s (pid %d) died' % (role, victim) in out
  summary = json.load(open(run_dir / 'summary.json'))
  assert summary['extra']['worker_restarts'] == 1
  assert summary['extra']['segments_duplicated'] == 0
  # 30 iterations of 2 groups each: every iteration trained on exactly two complete, distinct segments.
  assert summary['iterations'] == 30 and summary['extra']['segments_consumed'] == 60
  assert summary['best_eval_return'] > 2 * summary['eval_curve'][0]['return']
  assert not _our_segments(workers['controller'])


def test_ctrl_c_leaves_no_process_and_no_shared_memory(tmp_path):
  run_dir = tmp_path / 'interrupt'
  # (--use_mps on a machine without MPS is refused before anything starts: tests/test_validation.py.)
  proc = _launch(run_dir, '--schedule=async', '--num_groups=2', '--num_timesteps=10000000', '--num_evals=2000')
  try:
    assert _wait_for(lambda: _trained_iterations(run_dir) >= 2, 240, proc)
    workers = json.load(open(run_dir / 'workers.json'))
    assert _our_segments(workers['controller'])
    # Each worker runs on the cores the plan gave it (--pin_cpus is on by default).
    from ebrl_jax.resources import cpus  # pylint: disable=g-import-not-at-top
    plan = cpus.plan_cores(cpus.available_cores(), ['rollout/0', 'rollout/1'], ['trainer', 'evaluator'])
    for role, pid in workers['workers'].items():
      assert os.sched_getaffinity(pid) == set(plan[role]), role
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  _assert_workers_gone(workers)
  # The checkpoint written before the interrupt still restores: resume continues its step count.
  summary = controller.run(
      config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum', num_envs=32, num_eval_envs=8, num_threads=1),
                        algo=config_lib.AlgoConfig(batch_size=32, num_minibatches=8),
                        schedule=config_lib.ScheduleConfig(name='sync',
                                                           transport='thread',
                                                           num_groups=1,
                                                           num_timesteps=1,
                                                           num_evals=1,
                                                           run_dir=str(run_dir),
                                                           resume=True,
                                                           compilation_cache_dir='',
                                                           progress_bar=False)))
  assert summary.env_steps >= 1280 * 2


def test_killed_trainer_stops_the_run_with_its_checkpoint_intact(tmp_path):
  run_dir = tmp_path / 'trainer_dies'
  proc = _launch(run_dir, '--schedule=async', '--num_groups=2', '--num_timesteps=10000000', '--num_evals=2000')
  try:
    assert _wait_for(
        lambda: os.path.isdir(run_dir / 'checkpoints') and any(n.isdigit()
                                                               for n in os.listdir(run_dir / 'checkpoints')), 240, proc)
    workers = json.load(open(run_dir / 'workers.json'))
    os.kill(workers['workers']['trainer'], signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode != 0
  assert 'the trainer worker (pid %d) died with exit code -9' % workers['workers']['trainer'] in out
  assert 'continue with --resume' in out
  assert not [p for p in workers['workers'].values() if lifecycle.pid_alive(p)]
  assert not _our_segments(workers['controller'])
  steps = sorted(int(n) for n in os.listdir(run_dir / 'checkpoints') if n.isdigit())
  assert steps
  from ebrl_jax.trainer import checkpoint  # pylint: disable=g-import-not-at-top
  with checkpoint.Checkpointer(str(run_dir / 'checkpoints')) as ckpt:
    assert ckpt.latest_step() == steps[-1]


def test_a_worker_that_keeps_dying_stops_the_run_after_max_restarts(tmp_path, monkeypatch):
  from ebrl_jax.rollout import worker as rollout_worker  # pylint: disable=g-import-not-at-top
  starts = []

  def crash(cfg, group, channels, incarnation=0, env=None, control=None):
    del cfg, channels, incarnation, env, control
    starts.append(group)
    raise RuntimeError('cannot start (e.g. at its SM quota)')

  monkeypatch.setattr(rollout_worker, 'rollout_main', crash)
  cfg = _config(tmp_path / 'crashy', schedule='async', transport='thread', num_groups=1, max_restarts=2)
  with pytest.raises(controller.RunError,
                     match=r'^a worker failed: rollout/0 died 3 times .* more than --max_restarts=2; the run stopped'):
    controller.run(cfg)
  assert starts == [0, 0, 0]  # the first start and two restarts
  summary = json.load(open(tmp_path / 'crashy' / 'summary.json'))  # written like a stop's, then raised
  assert summary['stopped'] == 'worker_failed' and 'more than --max_restarts=2' in summary['extra']['failure']


def test_a_stalled_start_up_is_reported_worker_by_worker(tmp_path, monkeypatch, caplog):
  """Until the first train step the controller says what each worker is doing; a run that fails before it says
  where each one was."""
  import logging as py_logging  # pylint: disable=g-import-not-at-top
  from ebrl_jax.controller import supervisor  # pylint: disable=g-import-not-at-top
  from ebrl_jax.rollout import worker as rollout_worker  # pylint: disable=g-import-not-at-top

  def stall(cfg, group, channels, incarnation=0, env=None, control=None):
    del channels, incarnation, env, control
    lifecycle.Phase(cfg.process.run_dir, f'rollout/{group}')('compiling a very slow program')
    time.sleep(1.5)
    raise RuntimeError('gave up')

  monkeypatch.setattr(rollout_worker, 'rollout_main', stall)
  monkeypatch.setattr(supervisor, '_STARTUP_LOG_S', 0.5)
  cfg = _config(tmp_path / 'stall', schedule='async', transport='thread', num_groups=1, worker_fault='stop')
  with caplog.at_level(py_logging.INFO), pytest.raises(controller.RunError, match='rollout/0'):
    controller.run(cfg)
  lines = [r.getMessage() for r in caplog.records]
  periodic = [m for m in lines if m.startswith('start-up ') and 'no train step yet' in m]
  assert periodic and 'rollout/0: compiling a very slow program' in periodic[-1]
  final = [m for m in lines if m.startswith('stopped during start-up')]
  assert len(final) == 1
  assert 'rollout/0: compiling a very slow program' in final[0]
  # The trainer is somewhere in its own start-up, by then most likely waiting for the group's first segment.
  assert re.search(
      r'trainer: (initialising|building|publishing|the first evaluation|waiting for the first '
      r'segments \(0 of 1 groups in\))', final[0]), final[0]


def test_phase_reports_write_on_change_stop_after_done_and_never_raise(tmp_path):
  phase = lifecycle.Phase(str(tmp_path), 'rollout/3#1')
  phase('building its envs')
  first = lifecycle.read_phases(str(tmp_path))['rollout/3#1']
  phase('building its envs')  # unchanged: not rewritten
  assert lifecycle.read_phases(str(tmp_path))['rollout/3#1']['since'] == first['since']
  phase.done('collecting')
  phase('something after done')  # ignored
  assert lifecycle.read_phases(str(tmp_path))['rollout/3#1']['phase'] == 'collecting'
  line = lifecycle.describe_phases(str(tmp_path), now=first['since'] + 12.4)
  assert line == 'rollout/3#1: collecting (12 s)'
  assert 'no worker has reported' in lifecycle.describe_phases(str(tmp_path / 'elsewhere'))
  (tmp_path / 'file').write_text('')
  lifecycle.Phase(str(tmp_path / 'file'), 'trainer')('cannot write here')  # a run dir that is a file: no raise


def test_mps_daemon_death_stops_the_run_and_resume_continues(tmp_path, fake_pynvml):
  """The stand-in MPS control binary stops answering mid-run: the controller names the daemon's pipe directory,
  stops every worker, frees shared memory, keeps the checkpoint, and says to resume; --resume then continues.
  A stand-in NVML reports a 24 GiB GPU, so both runs make a memory plan (4 processes with a GPU context: the
  trainer, the evaluator and two rollout workers)."""
  run_dir, dead, calls = tmp_path / 'mps_dies', tmp_path / 'daemon_dead', tmp_path / 'mps_calls.log'
  env = {
      'PATH': f'{FAKES}:{os.environ["PATH"]}',
      'PYTHONPATH': os.pathsep.join([FAKES, ROOT]),
      'FAKE_MPS_DEAD': str(dead),
      'FAKE_MPS_LOG': str(calls),
      'EBRL_FAKE_GPU_MIB': '24576',
      'CUDA_MPS_PIPE_DIRECTORY': ''
  }
  proc = _launch(run_dir,
                 '--schedule=async',
                 '--num_groups=2',
                 '--use_mps',
                 '--num_evals=2000',
                 '--num_timesteps=10000000',
                 env=env)
  try:
    assert _wait_for(
        lambda: os.path.isdir(run_dir / 'checkpoints') and any(n.isdigit()
                                                               for n in os.listdir(run_dir / 'checkpoints')), 240, proc)
    workers = json.load(open(run_dir / 'workers.json'))
    dead.write_text('')
    out, _ = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  pipe = run_dir / 'mps' / 'pipe'
  assert proc.returncode == 3, out[-3000:]  # a RunError
  assert f'The MPS daemon serving pipe directory {pipe} died' in out
  assert f'the MPS daemon (pipe directory {pipe}) died mid-run' in out and 'continue with --resume' in out
  assert 'GPU memory plan on 24576 MiB' in out
  assert 'quit' not in calls.read_text()  # a dead daemon is not asked to quit
  _assert_workers_gone(workers)
  from ebrl_jax.trainer import checkpoint  # pylint: disable=g-import-not-at-top
  with checkpoint.Checkpointer(str(run_dir / 'checkpoints')) as ckpt:
    step = ckpt.latest_step()
  assert step
  # Resume (in threads, to be quick) for two iterations of 1280 env steps past the checkpoint.
  fake_pynvml(24576)
  summary = controller.run(
      _config(run_dir,
              schedule='sync',
              transport='thread',
              num_groups=1,
              num_timesteps=(step + 2) * 1280,
              num_evals=1,
              resume=True))
  assert summary.iterations == step + 2 and summary.env_steps == (step + 2) * 1280
  plan = summary.extra['memory_plan']
  assert plan['device_total_mib'] == 24576 and set(plan['roles']) == {'trainer', 'evaluator', 'rollout/0'}
  assert all(r['budget_mib'] >= r['footprint_mib'] * 1.5 for r in plan['roles'].values())
