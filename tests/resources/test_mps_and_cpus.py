"""MPS daemon lifecycle against a stand-in control binary (no GPU here), and the CPU core plan by hand."""
import os
import stat

import pytest

from ebrl_jax.resources import cpus
from ebrl_jax.runtime import startup
from ebrl_jax.resources import mps

FAKES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'fakes')


def _fake_control(tmp_path, monkeypatch, mode='ok'):
  """tests/fakes/nvidia-cuda-mps-control first on PATH, logging its calls to the returned file."""
  log = tmp_path / 'calls.log'
  monkeypatch.setenv('PATH', f'{FAKES}:{os.environ["PATH"]}')
  monkeypatch.setenv('FAKE_MPS_LOG', str(log))
  monkeypatch.setenv('FAKE_MPS_MODE', mode)
  monkeypatch.delenv('CUDA_MPS_PIPE_DIRECTORY', raising=False)
  return log


def test_without_the_control_binary_mps_is_off_with_a_warning(tmp_path, monkeypatch):
  monkeypatch.setenv('PATH', str(tmp_path))  # nothing there
  daemon = mps.MpsDaemon(str(tmp_path / 'run'))
  assert daemon.start() is False
  assert daemon.worker_env(30) == {}
  daemon.stop()  # harmless


def test_start_gives_workers_a_private_pipe_and_quota_and_stop_quits_it(tmp_path, monkeypatch):
  log = _fake_control(tmp_path, monkeypatch)
  daemon = mps.MpsDaemon(str(tmp_path / 'run'))
  assert daemon.start() is True and daemon.started_here
  pipe = str(tmp_path / 'run' / 'mps' / 'pipe')
  assert stat.S_IMODE(os.stat(pipe).st_mode) == 0o700
  assert daemon.worker_env(30) == {
      'CUDA_MPS_PIPE_DIRECTORY': pipe,
      'CUDA_MPS_LOG_DIRECTORY': str(tmp_path / 'run' / 'mps' / 'log'),
      'CUDA_MPS_ACTIVE_THREAD_PERCENTAGE': '30'
  }
  daemon.stop()
  daemon.stop()  # a second stop sends nothing more
  calls = log.read_text().splitlines()
  assert calls == [f'-d stdin= pipe={pipe}', f' stdin=get_server_list pipe={pipe}', f' stdin=quit pipe={pipe}']


def test_a_daemon_that_does_not_answer_never_hangs_the_run(tmp_path, monkeypatch):
  _fake_control(tmp_path, monkeypatch, mode='hang')
  daemon = mps.MpsDaemon(str(tmp_path / 'run'), timeout_s=0.5)
  assert daemon.start() is False  # `-d` timed out after 0.5 s
  assert not daemon.active


def test_a_daemon_that_fails_to_start_is_reported(tmp_path, monkeypatch):
  _fake_control(tmp_path, monkeypatch, mode='fail')
  assert mps.MpsDaemon(str(tmp_path / 'run')).start() is False


def test_an_existing_daemon_is_borrowed_not_stopped(tmp_path, monkeypatch):
  log = _fake_control(tmp_path, monkeypatch)
  pipe = tmp_path / 'shared_pipe'
  pipe.mkdir()
  (pipe / 'control').write_text('')
  monkeypatch.setenv('CUDA_MPS_PIPE_DIRECTORY', str(pipe))
  daemon = mps.MpsDaemon(str(tmp_path / 'run'))
  assert daemon.start() and not daemon.started_here
  assert daemon.worker_env()['CUDA_MPS_PIPE_DIRECTORY'] == str(pipe)
  daemon.stop()
  assert 'quit' not in log.read_text()


def test_core_plan_by_hand():
  # 16 cores, 4 CPU-simulating groups, trainer + generation: feeders take the last two cores (14, 15); the
  # 14 others split 4/4/3/3 in contiguous blocks.
  plan = cpus.plan_cores(range(16), ['rollout/0', 'rollout/1', 'rollout/2', 'rollout/3'], ['trainer', 'generation'])
  assert plan == {
      'trainer': [14],
      'generation': [15],
      'rollout/0': [0, 1, 2, 3],
      'rollout/1': [4, 5, 6, 7],
      'rollout/2': [8, 9, 10],
      'rollout/3': [11, 12, 13]
  }
  # 2 cores, 2 groups + trainer: fewer cores than roles, so they share round-robin.
  assert cpus.plan_cores([0, 1], ['rollout/0', 'rollout/1'], ['trainer']) == {
      'rollout/0': [0],
      'rollout/1': [1],
      'trainer': [0]
  }
  # MJX: every role feeds the GPU; 8 cores over 3 feeders -> 2 each.
  assert cpus.plan_cores(range(8), [], ['trainer', 'rollout/0', 'rollout/1']) == {
      'trainer': [0, 1],
      'rollout/0': [2, 3],
      'rollout/1': [4, 5]
  }
  with pytest.raises(ValueError, match='at least one core'):
    cpus.plan_cores([], ['rollout/0'], [])
  assert startup.decode_cores(startup.encode_cores([3, 5])) == [3, 5]
  with pytest.raises(ValueError, match="EBRL_CPUS='a,b'"):
    startup.decode_cores('a,b')


def test_a_daemon_that_dies_is_seen_and_not_sent_quit(tmp_path, monkeypatch):
  log = _fake_control(tmp_path, monkeypatch)
  dead = tmp_path / 'dead'
  monkeypatch.setenv('FAKE_MPS_DEAD', str(dead))
  daemon = mps.MpsDaemon(str(tmp_path / 'run'))
  assert daemon.start() and daemon.alive()
  dead.write_text('')  # from now on the control binary cannot reach a daemon
  assert not daemon.alive()
  daemon.lost()
  assert daemon.worker_env(30) == {} and not daemon.alive()
  daemon.stop()
  assert 'quit' not in log.read_text()


def test_feeders_take_their_core_after_startup_and_simulators_at_once(monkeypatch):
  # Native MuJoCo, separate generation: the rollouts (CPU simulators) are pinned when they start; the trainer, the
  # generation worker and the evaluator compile on every core and take their own core once compiled
  # (pin_after_startup).
  import os  # pylint: disable=g-import-not-at-top
  from ebrl_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from ebrl_jax.controller import supervisor  # pylint: disable=g-import-not-at-top
  from ebrl_jax.controller import topology  # pylint: disable=g-import-not-at-top
  from ebrl_jax.resources import memory  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(cpus, 'available_cores', lambda: list(range(6)))
  cfg = config_lib.Config(sim=config_lib.SimConfig(num_envs=32, num_eval_envs=4),
                          algo=config_lib.AlgoConfig(batch_size=32, num_minibatches=8),
                          schedule=config_lib.ScheduleConfig(name='async', num_groups=2, colocate_generation=False))
  plan = memory.make_plan(cfg, ['trainer', 'generation', 'evaluator'], None)
  placement = supervisor.Placement(cfg, topology.make_topology(cfg), None, plan)
  # 6 cores: generation, trainer and evaluator one each (the last three), the two rollouts the other three.
  assert placement.env('rollout/0')['EBRL_CPUS'] == '0,1' and placement.env('rollout/1')['EBRL_CPUS'] == '2'
  after = []
  for role in ('trainer', 'generation', 'evaluator'):
    env = placement.env(role)
    assert 'EBRL_CPUS' not in env
    after.append(env['EBRL_CPUS_AFTER_STARTUP'])
  assert sorted(after) == ['3', '4', '5']
  mine = sorted(os.sched_getaffinity(0))
  pinned = []
  monkeypatch.setattr(startup, 'pin', pinned.append)
  monkeypatch.setenv('EBRL_CPUS_AFTER_STARTUP', startup.encode_cores(mine[:1]))
  startup.pin_after_startup()
  startup.pin_after_startup()  # once only
  assert pinned == [mine[:1]] and 'EBRL_CPUS_AFTER_STARTUP' not in os.environ
