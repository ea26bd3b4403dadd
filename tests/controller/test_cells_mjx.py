"""MJX fused cells (issue 16): two cells of `--schedule=fused --backend=mjx` through `--launcher=local` (CPU, gloo)
each collect their own envs with one jitted program and train through the step over the ranks, so both hold the
same parameters after every step (the chained sha256 in each rank's summary) and rank 0's final checkpoint is one
rank trained on the concatenation of the two cells' batches (each collected from its own keys, `keys.cell_key`),
to float tolerance, for PPO and GRPO. Opt-in (MJX compiles in three processes: minutes on 2 cores); the loop's
CI sibling is test_data_parallel's fused iterations over 2 ranks on stand-in rollouts."""
import json
import os
import subprocess
import sys
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebrl_jax import main
from ebrl_jax.rollout import keys
from ebrl_jax.rollout import mjx as mjx_rollout
from ebrl_jax.sim import stages as sim_stages
from ebrl_jax.trainer import checkpoint
from ebrl_jax.trainer import driver
from ebrl_jax.trainer import stages as trainer_stages

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERATIONS, CELLS = 3, 2
# One minibatch per epoch and no entropy bonus: the ranks' step is then one rank's on the concatenated batch, to
# rounding (see tests/trainer/dp_cases.py).
COMMON = ('--task=inverted_pendulum', '--backend=mjx', '--schedule=fused', '--num_envs=8', '--num_eval_envs=2',
          '--num_minibatches=1', '--num_updates_per_batch=2', '--entropy_cost=0', '--policy_hidden_sizes=16,16',
          '--value_hidden_sizes=16,16', '--num_evals=1', '--compilation_cache_dir=', '--noprogress_bar',
          '--heartbeat_timeout_s=10', '--telemetry_period_s=0')
ALGOS = {  # flags, env steps per cell and iteration
    'ppo': (('--batch_size=8', '--unroll_length=5', '--episode_length=50'), 8 * 5),
    'grpo': (('--algo=grpo', '--group_size=2', '--batch_size=8', '--episode_length=10'), 8 * 10),
}


def _config(*flag_list):
  values = flags.FlagValues()
  main.define_flags(values)
  values(['prog', *flag_list])
  return main.config_from_flags(values)


def _one_rank_reference(cfg):
  """One rank trained on the cells' batches concatenated in rank order, each cell's envs and rollouts from its
  own keys, as the fused cells collect them."""
  spec, network, optimizer = driver.network_and_optimizer(cfg.sim, cfg.policy, cfg.algo)
  root = keys.root(cfg.schedule.seed)
  state = trainer_stages.init_train_state(network, optimizer, keys.init_key(root), spec.obs_dim,
                                          cfg.policy.normalize_observations, spec.pixel_shape)
  env = mjx_rollout.make_env(cfg.sim, auto_reset=not cfg.algo.episodic)
  reset = jax.jit(sim_stages.reset, static_argnums=(0, 2, 3))
  collect = jax.jit(mjx_rollout.collect_iteration, static_argnums=(0, 1, 2, 3))
  train = trainer_stages.make_train_fn(network, optimizer, cfg.algo, cfg.policy.min_std, cfg.sim.group_size, False)
  roots = [keys.cell_key(root, c) for c in range(CELLS)]
  env_states = [reset(env, keys.env_reset_key(r, 0), cfg.sim.num_envs, cfg.sim.group_size) for r in roots]
  for iteration in range(ITERATIONS):
    batches = []
    for c in range(CELLS):
      env_states[c], batch, _ = collect(env, network, cfg.collect_spec, cfg.sim.num_envs, state.params,
                                        jnp.int32(iteration), env_states[c], keys.rollout_key(roots[c], iteration, 0))
      batches.append(batch)
    batch = jax.tree_util.tree_map(lambda *x: jnp.concatenate(x, axis=1), *batches)
    state, _ = train(state, batch, keys.train_key(root, iteration))
  return state


@pytest.mark.parametrize('algo', sorted(ALGOS))
def test_two_mjx_fused_cells_train_as_one_rank_on_the_global_batch(tmp_path, algo):
  algo_flags, per_cell = ALGOS[algo]
  run_dir = tmp_path / 'run'
  flag_list = (*COMMON, *algo_flags, f'--num_timesteps={ITERATIONS * CELLS * per_cell}', f'--run_dir={run_dir}')
  t0 = time.monotonic()
  two = subprocess.run(
      [sys.executable, '-m', 'ebrl_jax.main', *flag_list, '--launcher=local', f'--num_processes={CELLS}'],
      cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS='cpu'),
      capture_output=True,
      text=True,
      timeout=900)
  print(f'2 MJX fused cells ({algo}): {time.monotonic() - t0:.1f} s')
  assert two.returncode == 0, two.stderr[-4000:]
  summaries = []
  for path in (run_dir / 'summary.json', run_dir / 'rank1' / 'summary.json'):
    with open(path) as f:
      summaries.append(json.load(f))
  rank0, rank1 = summaries
  assert rank0['backend'] == 'mjx' and rank0['iterations'] == rank1['iterations'] == ITERATIONS
  assert rank0['env_steps'] == ITERATIONS * CELLS * per_cell
  cells0, cells1 = rank0['extra']['cells'], rank1['extra']['cells']
  assert cells0['env_steps_per_iteration'] == CELLS * per_cell and cells0['allreduce_timings'] >= 1
  assert cells0['params_chain'] and cells0['params_chain'] == cells1['params_chain'], 'the ranks diverged'
  assert [e['return'] for e in rank0['eval_curve']] == [e['return'] for e in rank1['eval_curve']]

  t0 = time.monotonic()
  cfg = _config(*flag_list)
  want = _one_rank_reference(cfg)
  print(f'the one-rank reference: {time.monotonic() - t0:.1f} s')
  with checkpoint.Checkpointer(str(run_dir / 'checkpoints')) as ckpt:
    assert max(ckpt.all_steps()) == ITERATIONS
    got, _, _ = ckpt.restore(want)  # the newest: the end of the run
  assert int(got.policy_version) == ITERATIONS
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got.params), jax.tree_util.tree_leaves(want.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5, err_msg=jax.tree_util.keystr(path))
