"""A clean stop of a run of several cells (issue 16): the ranks agree on the stop through the vote their train step
carries (`trainer.ranks`), so every rank stops after the same step, rank 0 saves a loadable checkpoint there, each
rank writes its summary with `stopped`, and no process is left. Two fused cells through `--launcher=local` stop on
--max_wall_s (each rank's own clock) at one iteration, with the all-reduce timed beside the step; a SIGTERM to the
launcher of two async cells (each with its own rollout worker process) stops them together and `--resume`
continues on one cell; a SIGTERM to one fused cell alone stops both after the same step (both opt-in). In-process: the vote, the signals that become it, and the launcher waiting for
cells that stopped together."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import cells_testlib  # pylint: disable=g-bad-import-order
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax.controller import cells as cells_lib
from ebrl_jax.runtime import launch
from ebrl_jax.runtime import lifecycle
from ebrl_jax.trainer import checkpoint
from ebrl_jax.trainer import driver
from ebrl_jax.trainer import ranks
from ebrl_jax.trainer import stages as trainer_stages
from tests import launch_testlib

# 8 envs x 2 unrolls x 5 steps = 80 env steps per cell and iteration; 2 cells: 160.
FLAGS = ('--task=inverted_pendulum', '--backend=mujoco_cpu', '--num_envs=8', '--num_eval_envs=4', '--num_threads=1',
         '--batch_size=8', '--num_minibatches=2', '--unroll_length=5', '--num_updates_per_batch=1',
         '--episode_length=100', '--policy_hidden_sizes=16,16', '--value_hidden_sizes=16,16', '--num_evals=1',
         '--compilation_cache_dir=', '--noprogress_bar', '--heartbeat_timeout_s=3', '--telemetry_period_s=0',
         '--num_timesteps=100000000', '--launcher=local', '--num_processes=2')
ASYNC = ('--schedule=async', '--num_groups=1', '--evaluator=trainer', '--max_staleness=1')


def _main(run_dir, *flags):
  return [sys.executable, '-m', 'ebrl_jax.main', *FLAGS, f'--run_dir={run_dir}', *flags]


def _summaries(run_dir):
  out = []
  for path in (run_dir / 'summary.json', run_dir / 'rank1' / 'summary.json'):
    with open(path) as f:
      out.append(json.load(f))
  return out


def _stopped_together(run_dir, reason):
  """Both ranks stopped after one step with one state; rank 0's checkpoint is at that step, intact."""
  rank0, rank1 = _summaries(run_dir)
  assert rank0['stopped'] == rank1['stopped'] == reason, (rank0['stopped'], rank1['stopped'])
  assert rank0['iterations'] == rank1['iterations'] > 0 and rank0['env_steps'] == 160 * rank0['iterations']
  cells0, cells1 = rank0['extra']['cells'], rank1['extra']['cells']
  assert cells0['stop'] == cells1['stop'] == {'reason': cells0['stop']['reason'], 'iteration': rank0['iterations']}
  assert cells0['params_chain'] == cells1['params_chain'], 'the ranks held different parameters at some step'
  assert rank0['extra']['last_checkpoint'] == rank0['iterations'] and rank1['extra']['last_checkpoint'] is None
  directory = str(run_dir / 'checkpoints')
  assert checkpoint.committed_steps(directory)[0] == rank0['iterations']
  assert checkpoint.damage(directory, rank0['iterations']) is None
  return rank0, cells0


def test_two_cells_stop_together_on_max_wall_s_with_a_checkpoint_and_the_allreduce_timed(tmp_path):
  run_dir = tmp_path / 'run'
  t0 = time.monotonic()
  run = subprocess.run(_main(run_dir, '--max_wall_s=20'),
                       cwd=cells_testlib.ROOT,
                       env=dict(os.environ, JAX_PLATFORMS='cpu'),
                       capture_output=True,
                       text=True,
                       timeout=240)
  assert run.returncode == 0, run.stderr[-4000:]
  rank0, cells = _stopped_together(run_dir, 'max_wall_s')  # at iteration 1 where start-up took the budget
  print(f'2 fused cells to --max_wall_s=20: {time.monotonic() - t0:.1f} s, stopped together at iteration '
        f'{rank0["iterations"]} (start-up {rank0["compile_s"]:.1f} s)')
  assert rank0['env_steps'] < 100000000
  rank1 = _summaries(run_dir)[1]  # the budget's final evaluation, of the policy both ranks stopped with
  assert rank0['eval_curve'][-1]['env_steps'] == rank1['eval_curve'][-1]['env_steps'] == rank0['env_steps']
  assert rank0['final_eval_return'] == rank1['final_eval_return'] is not None
  assert not any(lifecycle.pid_alive(p) for p in cells_testlib.cell_pids(run.stderr))
  # The all-reduce of the gradients' size, timed alone over the two ranks (gloo), beside the train step's time.
  assert 0 < cells['allreduce_s'] < 5 and 0 < cells['train_step_s'] < 5 and cells['allreduce_timings'] >= 1
  assert cells['allreduce_fraction'] == pytest.approx(cells['allreduce_s'] / cells['train_step_s'])
  # The checkpoint loads into this run's train state (what --resume restores).
  cfg = config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum', num_envs=8, episode_length=100),
                          policy=config_lib.PolicyConfig(policy_hidden_sizes=(16, 16), value_hidden_sizes=(16, 16)),
                          algo=config_lib.AlgoConfig(batch_size=8, num_minibatches=2, num_updates_per_batch=1))
  spec, network, optimizer = driver.network_and_optimizer(cfg.sim, cfg.policy, cfg.algo)
  template = trainer_stages.init_train_state(network, optimizer, jax.random.PRNGKey(0), spec.obs_dim,
                                             cfg.policy.normalize_observations)
  with checkpoint.Checkpointer(str(run_dir / 'checkpoints')) as ckpt:
    state, extra, step = ckpt.restore(template)
  assert step == extra['iterations'] == int(state.policy_version) == rank0['iterations']
  assert extra['env_steps'] == rank0['env_steps']
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(state.params))


def test_a_sigterm_to_the_launcher_stops_async_cells_together_and_resume_continues(tmp_path):
  run_dir = tmp_path / 'run'
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  t0 = time.monotonic()
  launched = cells_testlib.Launched(_main(run_dir, *ASYNC), run_dir)
  time.sleep(1.0)
  workers = [p for r in (run_dir, run_dir / 'rank1') for p in cells_testlib.workers(r)]
  launched.process.send_signal(signal.SIGTERM)
  code = launched.wait(180)
  out = launched.output()
  print(f'2 async cells, SIGTERM to the launcher: {time.monotonic() - t0:.1f} s')
  assert code == 128 + signal.SIGTERM, out[-4000:]
  assert re.search(
      r'STOPPED: SIGTERM passed on to 2 cells \(rank 0: exit code 143; rank 1: exit code 143\); '
      r'rank 0 stopped \(SIGTERM\) at iteration \d+\. checkpoint \d+ in \S+ is loadable', out), out[-4000:]
  rank0, cells = _stopped_together(run_dir, 'SIGTERM')
  assert cells['stop']['reason'] == 'SIGINT'  # the trainers' vote: their controllers' request (SIGINT)
  assert not any(lifecycle.pid_alive(p) for p in workers + cells_testlib.cell_pids(out)), workers
  controllers = cells_testlib.cell_pids(out)  # each cell's shared memory went with its run
  assert not [n for n in os.listdir('/dev/shm') if any(n.startswith(f'ebrl_{c}_') for c in controllers)]
  # One cell (its workers as threads) continues the global state: 2 more iterations of 80 env steps.
  stopped_at = rank0['iterations']
  one = subprocess.run(_main(run_dir, *ASYNC, '--transport=thread', '--resume', '--launcher=', '--num_processes=1',
                             f'--num_timesteps={160 * stopped_at + 160}'),
                       cwd=cells_testlib.ROOT,
                       env=env,
                       capture_output=True,
                       text=True,
                       timeout=240)
  assert one.returncode == 0, one.stderr[-4000:]
  with open(run_dir / 'summary.json') as f:
    resumed = json.load(f)
  assert resumed['extra']['resumed_from']['iterations'] == stopped_at
  assert resumed['iterations'] == stopped_at + 2 and resumed['env_steps'] == 160 * stopped_at + 160


def test_a_sigterm_to_one_fused_cell_stops_both_after_the_same_step(tmp_path):
  run_dir = tmp_path / 'run'
  launched = cells_testlib.Launched(_main(run_dir), run_dir)
  pids = launched.cell_pids()
  t0 = time.monotonic()
  os.kill(pids[1], signal.SIGTERM)  # as SLURM's scancel or a node's shutdown would: not through the launcher
  code = launched.wait(180)
  out = launched.output()
  print(f'SIGTERM to fused cell 1: both stopped {time.monotonic() - t0:.1f} s later')
  assert code == 128 + signal.SIGTERM, out[-4000:]
  assert 'STOPPED: the cells stopped together on SIGTERM (sent to a cell, not here) (rank 0: exit code 143; rank 1: ' \
      'exit code 143)' in out, out[-4000:]
  _, cells = _stopped_together(run_dir, 'SIGTERM')  # rank 0 learned it from the step rank 1 voted at
  assert cells['stop']['reason'] == 'SIGTERM' and not any(lifecycle.pid_alive(p) for p in pids)


def test_the_vote_is_a_signal_else_the_budget_and_a_second_signal_interrupts():
  assert ranks.StopVote().wish() == ''
  assert ranks.StopVote(budget_s=5.0, start_unix=time.time() - 6.0).wish() == 'max_wall_s'
  assert ranks.StopVote(budget_s=5.0, start_unix=time.time()).wish() == ''
  flag = threading.Event()
  vote = ranks.StopVote(budget_s=5.0, start_unix=time.time() - 6.0, asked=lambda: 'SIGINT' if flag.is_set() else None)
  assert vote.wish() == 'max_wall_s'
  flag.set()
  assert vote.wish() == 'SIGINT'  # a signal outranks the budget (parallel.STOP_REASONS: the largest vote wins)
  vote = ranks.StopVote()
  before = signal.getsignal(signal.SIGTERM)
  with cells_lib.signals_vote(vote):
    os.kill(os.getpid(), signal.SIGTERM)
    assert vote.wish() == 'SIGTERM'
    with pytest.raises(KeyboardInterrupt, match='SIGINT'):  # a second signal: this rank stops at once
      os.kill(os.getpid(), signal.SIGINT)
  assert signal.getsignal(signal.SIGTERM) is before
  with cells_lib.signals_vote(None):  # one cell: nothing changes
    assert signal.getsignal(signal.SIGTERM) is before
  assert ranks.stopped_together({'stop': {'reason': 'SIGTERM', 'iteration': 3}})
  assert not ranks.stopped_together({'stop': None}) and not ranks.stopped_together({})
  config_lib.Config(schedule=config_lib.ScheduleConfig(max_wall_s=5), cells=config_lib.CellConfig(num_processes=2))


_Cell = launch_testlib.StandInCell


def test_the_launcher_waits_for_cells_that_stopped_together_and_signals_none(tmp_path, capsys):
  now = time.monotonic()
  agreed = {'stopped': 'SIGTERM', 'iterations': 3, 'extra': {'cells': {'stop': {'reason': 'SIGTERM', 'iteration': 3}}}}
  cells = [
      _Cell(11, 143, now + 0.3, (str(tmp_path / 'summary.json'), agreed)),
      _Cell(12, 143, now + 0.1, (str(tmp_path / 'rank1' / 'summary.json'), agreed))
  ]  # rank 1 was sent SIGTERM by someone else
  code = launch.watch(cells, ['h', 'h'], str(tmp_path), 3, lambda: None, 0.02)
  assert code == 143 and [c.signals for c in cells] == [[], []]  # rank 0 stopped on the vote, unsignalled
  err = capsys.readouterr().err
  assert ('STOPPED: the cells stopped together on SIGTERM (sent to a cell, not here) (rank 0: exit code 143; rank 1: '
          'exit code 143); rank 0 stopped (SIGTERM) at iteration 3.') in err, err
  cells = [_Cell(11, 143, now + 0.5), _Cell(12, 143, now + 0.5)]
  code = launch.watch(cells, ['h', 'h'], str(tmp_path), 3, lambda: 'SIGTERM', 0.02)
  assert code == 143 and [c.signals for c in cells] == [[signal.SIGTERM], [signal.SIGTERM]]  # passed on once
  assert 'STOPPED: SIGTERM passed on to 2 cells' in capsys.readouterr().err
