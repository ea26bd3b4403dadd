"""Cells (issue 16): `fused` runs as one trainer rank per process through the real entry point, on CPU with gloo
collectives. Two cells started by `--launcher=local` hold the same parameters after every step (a sha256 chained
over each step's parameters, in each rank's summary), count the global batch in the summary, and rank 0's
checkpoint continues on one cell; a killed cell stops the run with a message naming it and leaves no process. The
same for `async` cells (each a controller, its trainer worker the rank, its own rollout worker process): one
parameter chain on both ranks, a resume on one cell, a killed cell naming rank 1 (opt-in)."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import cells_testlib  # pylint: disable=g-bad-import-order
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax.controller import cells as cells_lib
from ebrl_jax.controller import topology as topology_lib
from ebrl_jax.rollout import keys
from ebrl_jax.runtime import distributed
from ebrl_jax.runtime import launch as launch_lib
from ebrl_jax.runtime import lifecycle
from ebrl_jax.trainer import checkpoint

# 8 envs x 2 unrolls x 5 steps = 80 env steps per cell and iteration; 2 cells: 160.
FLAGS = ('--task=inverted_pendulum', '--backend=mujoco_cpu', '--num_envs=8', '--num_eval_envs=4', '--num_threads=1',
         '--batch_size=8', '--num_minibatches=2', '--unroll_length=5', '--num_updates_per_batch=1',
         '--episode_length=100', '--policy_hidden_sizes=16,16', '--value_hidden_sizes=16,16', '--num_evals=2',
         '--compilation_cache_dir=', '--noprogress_bar', '--heartbeat_timeout_s=3', '--telemetry_period_s=0')


def _main(run_dir, *flags):
  return [sys.executable, '-m', 'ebrl_jax.main', *FLAGS, f'--run_dir={run_dir}', *flags]


def _run(run_dir, *flags, timeout=240):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  return subprocess.run(_main(run_dir, *flags),
                        cwd=cells_testlib.ROOT,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=timeout)


def _summary(path):
  with open(path) as f:
    return json.load(f)


def test_two_cells_hold_one_state_count_the_global_batch_and_resume_on_one_cell(tmp_path):
  run_dir = tmp_path / 'run'
  two = _run(run_dir, '--launcher=local', '--num_processes=2', '--num_timesteps=1600')
  assert two.returncode == 0, two.stderr[-4000:]
  rank0, rank1 = _summary(run_dir / 'summary.json'), _summary(run_dir / 'rank1' / 'summary.json')
  assert rank0['env_steps'] == rank1['env_steps'] == 1600 and rank0['iterations'] == 10  # 10 x 2 cells x 80
  cells0, cells1 = rank0['extra']['cells'], rank1['extra']['cells']
  assert (cells0['count'], cells0['rank'], cells1['rank'], cells0['env_steps_per_iteration']) == (2, 0, 1, 160)
  assert cells0['params_chain'] == cells1['params_chain'], 'the ranks held different parameters at some step'
  returns = [[e['return'] for e in r['eval_curve']] for r in (rank0, rank1)]
  assert returns[0] == returns[1]  # the same parameters, keys and eval envs: every rank decides alike
  assert not os.path.exists(run_dir / 'rank1' / 'checkpoints')  # rank 0 alone checkpoints
  assert checkpoint.committed_steps(str(run_dir / 'checkpoints'))[0] == 10
  # One cell continues the global state: 8 more iterations of 80 env steps from env step 1600.
  one = _run(run_dir, '--resume', '--num_timesteps=2240')
  assert one.returncode == 0, one.stderr[-4000:]
  resumed = _summary(run_dir / 'summary.json')
  assert resumed['extra']['resumed_from']['env_steps'] == 1600 and resumed['env_steps'] == 2240
  assert resumed['iterations'] == 18 and 'cells' not in resumed['extra']


def test_a_killed_cell_stops_the_run_naming_it_and_leaves_nothing_behind(tmp_path):
  run_dir = tmp_path / 'run'
  launched = cells_testlib.Launched(
      _main(run_dir, '--launcher=local', '--num_processes=2', '--num_timesteps=40000', '--num_evals=125'), run_dir)
  pid0, pid1 = launched.cell_pids()
  time.sleep(1.0)
  os.kill(pid1, signal.SIGKILL)
  code = launched.wait(120)
  out = launched.output()
  assert code == 3, out[-4000:]
  fatal = re.search(
      r'FATAL: cell rank 1 \(pid (\d+) on (\S+)\) died \(killed by SIGKILL\); the other cells stopped: '
      r'rank 0 after ([\d.]+) s', out)
  assert fatal and int(fatal.group(1)) == pid1 and fatal.group(2) == socket.gethostname(), out[-4000:]
  assert re.search(rf'trainer rank 1 \({re.escape(socket.gethostname())} pid {pid1}\) died', out), out[-4000:]
  print(f'rank 0 stopped {fatal.group(3)} s after rank 1 was killed')
  assert float(fatal.group(3)) < 30
  assert not lifecycle.pid_alive(pid0) and not lifecycle.pid_alive(pid1)
  directory = str(run_dir / 'checkpoints')
  steps = checkpoint.committed_steps(directory)
  assert steps and checkpoint.damage(directory, steps[0]) is None, steps


def test_cell_keys_and_flag_errors():
  root = keys.root(0)
  assert (keys.cell_key(root, 0) == root).all() and not (keys.cell_key(root, 1) == root).all()
  assert keys.env_seed(0, keys.ENV_RESET, 0, cell=0) == keys.env_seed(0, keys.ENV_RESET, 0)
  assert keys.env_seed(0, keys.ENV_RESET, 0, cell=1) != keys.env_seed(0, keys.ENV_RESET, 0)
  with pytest.raises(ValueError, match='--launcher=local needs --num_processes'):
    config_lib.CellConfig(launcher='local')
  two = config_lib.CellConfig(num_processes=2)
  config_lib.Config(schedule=config_lib.ScheduleConfig(name='sync'), cells=two)  # a trainer rank per cell
  for backend in ('mujoco_cpu', 'mjx', 'mjx_warp'):  # fused cells on every backend (MJX: the chunk split, issue 16)
    config_lib.Config(sim=config_lib.SimConfig(backend=backend), cells=two)
  with pytest.raises(ValueError, match='run --schedule=fused, sync or async'):
    config_lib.Config(schedule=config_lib.ScheduleConfig(name='overlap'), cells=two)
  with pytest.raises(ValueError, match='need --evaluator=trainer'):
    config_lib.Config(schedule=config_lib.ScheduleConfig(name='async', target_return=100.0), cells=two)
  with pytest.raises(ValueError, match='--group_schedule'):
    config_lib.Config(schedule=config_lib.ScheduleConfig(name='async', group_schedule='2:groups=1'), cells=two)


# async cells: each cell a controller with its own trainer worker (the rank) and one rollout worker process.
ASYNC = ('--schedule=async', '--num_groups=1', '--evaluator=trainer', '--max_staleness=1')


def test_two_async_cells_train_one_state_with_their_own_rollout_workers_and_resume_on_one(tmp_path):
  run_dir = tmp_path / 'run'
  t0 = time.monotonic()
  two = _run(run_dir, '--launcher=local', '--num_processes=2', '--num_timesteps=1600', *ASYNC)
  print(f'2 async cells: {time.monotonic() - t0:.1f} s')
  assert two.returncode == 0, two.stderr[-4000:]
  rank0, rank1 = _summary(run_dir / 'summary.json'), _summary(run_dir / 'rank1' / 'summary.json')
  assert rank0['env_steps'] == rank1['env_steps'] == 1600 and rank0['iterations'] == 10  # 10 x 2 cells x 80
  cells0, cells1 = rank0['extra']['cells'], rank1['extra']['cells']
  assert (cells0['count'], cells0['rank'], cells1['rank'], cells0['env_steps_per_iteration']) == (2, 0, 1, 160)
  assert cells0['params_chain'] and cells0['params_chain'] == cells1['params_chain'], 'the ranks diverged'
  assert rank0['extra']['topology']['cell'] == {'rank': 0, 'count': 2}
  assert rank1['extra']['topology']['roles'] == ['trainer', 'rollout/0']  # a cell's own workers, as on one GPU
  assert rank0['extra']['segments_consumed'] == rank1['extra']['segments_consumed'] == 10
  assert not os.path.exists(run_dir / 'rank1' / 'checkpoints')  # rank 0 alone checkpoints
  assert checkpoint.committed_steps(str(run_dir / 'checkpoints'))[0] == 10
  assert not any(lifecycle.pid_alive(p) for r in (run_dir, run_dir / 'rank1') for p in cells_testlib.workers(r))
  # One cell (its workers as threads: one process) continues the global state: 8 iterations of 80 env steps.
  one = _run(run_dir, '--resume', '--num_timesteps=2240', *ASYNC, '--transport=thread')
  assert one.returncode == 0, one.stderr[-4000:]
  resumed = _summary(run_dir / 'summary.json')
  assert resumed['extra']['resumed_from']['env_steps'] == 1600 and resumed['env_steps'] == 2240
  assert resumed['iterations'] == 18 and 'cells' not in resumed['extra']


def test_a_killed_async_cell_stops_the_run_naming_it_and_leaves_nothing_behind(tmp_path):
  run_dir = tmp_path / 'run'
  launched = cells_testlib.Launched(
      _main(run_dir, '--launcher=local', '--num_processes=2', '--num_timesteps=80000', '--num_evals=250', *ASYNC),
      run_dir)
  pids = launched.cell_pids()
  time.sleep(1.0)
  workers = cells_testlib.workers(run_dir) + cells_testlib.workers(run_dir / 'rank1')
  os.kill(pids[1], signal.SIGKILL)  # cell 1's controller: its workers go with it (parent-death signal)
  code = launched.wait(120)
  out = launched.output()
  assert code == 3, out[-4000:]
  fatal = re.search(
      r'FATAL: cell rank 1 \(pid \d+ on \S+\) died \(killed by SIGKILL\); the other cells stopped: '
      r'rank 0 after ([\d.]+) s', out)
  assert fatal, out[-4000:]
  print(f'async: rank 0 stopped {fatal.group(1)} s after cell 1 was killed')
  assert re.search(r'the trainer worker \(pid \d+\) stopped: trainer rank 1 \(\S+ pid \d+\) died', out), out[-4000:]
  deadline = time.monotonic() + 10  # the orphaned workers of cell 1 end on their parent-death signal
  while any(lifecycle.pid_alive(p) for p in workers) and time.monotonic() < deadline:
    time.sleep(0.2)
  assert not any(lifecycle.pid_alive(p) for p in workers), workers
  directory = str(run_dir / 'checkpoints')
  steps = checkpoint.committed_steps(directory)
  assert steps and checkpoint.damage(directory, steps[0]) is None, steps


def test_the_topology_describes_the_cell_and_one_gpu_is_the_cell_of_one(tmp_path):
  cfg = config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum', num_envs=8),
                          algo=config_lib.AlgoConfig(batch_size=8, num_minibatches=2),
                          schedule=config_lib.ScheduleConfig(name='async',
                                                             run_dir=str(tmp_path / 'rank1'),
                                                             num_groups=2,
                                                             colocate_generation=False))
  one = topology_lib.make_topology(cfg)
  spec = distributed.DistributedSpec('host0:1234', 2, 1)
  cell = topology_lib.make_topology(cfg, cells_lib.Cell(1, 2, spec, str(tmp_path)))
  assert one.cell == cells_lib.Cell(run_dir=cfg.schedule.run_dir) and one.trainer.ranks is None
  assert one.describe()['cell'] == {'rank': 0, 'count': 1} and cell.describe()['cell'] == {'rank': 1, 'count': 2}
  assert cell.roles == one.roles  # a cell's own workers, as on one GPU
  assert cell.trainer.env_steps_per_iteration == 2 * one.trainer.env_steps_per_iteration  # the global batch
  assert cell.trainer.ranks == spec and cell.trainer.checkpoint_run_dir == str(tmp_path)  # rank 0's checkpoints
  assert (one.rollout.cell, cell.rollout.cell, cell.generation.cell) == (0, 1, 1)  # the cell's own keys


def test_cells_started_with_different_flags_are_refused_by_every_rank_before_training(tmp_path):
  """Two fused ranks started by hand (as ssh or SLURM would) with another --seed and --learning_rate on rank 1.
  Before the check both trained apart and finished with exit code 0 (different parameter chains and curves); with
  another --num_timesteps one finished and the other called it dead."""
  port = launch_lib.free_port()
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  common = ('--num_processes=2', f'--coordinator_address=127.0.0.1:{port}', '--num_timesteps=1600')
  procs = [
      subprocess.Popen(_main(tmp_path / 'run', *common, f'--process_id={rank}', *extra),
                       cwd=cells_testlib.ROOT,
                       env=env,
                       stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE,
                       text=True) for rank, extra in ((0, ()), (1, ('--seed=7', '--learning_rate=0.1')))
  ]
  try:
    logs = [p.communicate(timeout=180)[1] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for rank, (p, log) in enumerate(zip(procs, logs)):
    fatal = [line for line in log.splitlines() if line.startswith('FATAL: ')]
    assert p.returncode == 3 and len(fatal) == 1, log[-3000:]
    mine, theirs = ('0.0003', '0.1') if rank == 0 else ('0.1', '0.0003')
    assert f'trainer rank {rank} and rank {1 - rank} were started with different settings' in fatal[0], fatal
    assert f'--learning_rate={mine} here, {theirs} there' in fatal[0] and '--seed=' in fatal[0], fatal
  assert not (tmp_path / 'run' / 'summary.json').exists() and not (tmp_path / 'run' / 'checkpoints').exists()
