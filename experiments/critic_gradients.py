"""Why W2's transformer did not learn to move: how much of each trunk parameter's gradient comes from the value
loss when the critic shares the policy's trunk (`--critic=shared`), against a separate MLP critic (`--critic=mlp`).

  python -m experiments.critic_gradients --flagfile=experiments/w2_transformer.flags --backend=mujoco_cpu \
      --num_envs=64 --out=experiments/results/critic_gradients_cpu.json

One real batch per critic: `--num_envs` native MuJoCo envs of the flagfile's task, stepped by the freshly
initialised policy for one iteration's segments (the run's unroll and action chunk), the observation normaliser
updated on it as `train_step` does. On that batch the PPO loss of the flagfile's settings is split into its terms
(policy, value, entropy: the loss is their sum, so each term's gradient is the loss's gradient with the other
costs set to 0) and each term's gradient norm is reported per parameter group: the trunk (every parameter both
heads read: embeddings, blocks, final LayerNorm), the action head, the critic (value head or MLP). Adam scales each
parameter's step by its own gradient's size, so where the value term's gradient is the larger by a factor, the
trunk's steps follow the value loss and the policy's signal is that factor smaller in them.
"""
from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ebrl_jax import main as ebrl_main
from ebrl_jax.generation import normalization
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.rollout import cpu as cpu_rollout
from ebrl_jax.trainer import driver
from ebrl_jax.trainer import losses
from experiments.bench import run as bench_run

_OUT = ebrl_main.FLAGS['out']  # experiments.bench.run's --out: where the JSON goes (stdout too)


def _group(path) -> str:
  top = str(getattr(path[1], 'key', path[1]))  # variables['params'][top]...
  if top == 'action_head':
    return 'action_head'
  if top in ('value_head', 'value', 'value_mlp'):
    return 'critic'
  return 'trunk'


def _norms(grads) -> dict:
  sums = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
    g = _group(path)
    sums[g] = sums.get(g, 0.0) + float(jnp.sum(jnp.square(leaf)))
  return {g: float(np.sqrt(v)) for g, v in sorted(sums.items())}


def measure(cfg, critic: str) -> dict:
  cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, critic=critic))
  spec, network, _ = driver.network_and_optimizer(cfg.sim, cfg.policy, cfg.algo)
  params = gen_stages.init_policy_params(network, jax.random.PRNGKey(cfg.schedule.seed), spec.obs_dim,
                                         cfg.policy.normalize_observations)
  collect = cfg.collect_spec
  pool = cpu_rollout.make_pool(cfg.sim, cfg.sim.num_envs, cfg.schedule.seed, auto_reset=True)
  try:
    collector = cpu_rollout.CpuCollector(pool, spec, gen_stages.make_act(network, cfg.policy.min_std), collect.unrolls,
                                         collect.steps, collect.action_chunk, False)
    batch, _ = collector.collect(params, 0, jax.random.PRNGKey(1))
    collector.close()
  finally:
    pool.close()
  batch = jax.tree.map(jnp.asarray, batch)
  params = params.replace(normalizer=normalization.update_stats(params.normalizer, batch.obs, batch.mask))

  def term_loss(net_params, algo):
    p = params.replace(network=net_params)
    return losses.ppo_loss(network, p, batch, batch.behaviour_log_prob, jax.random.PRNGKey(2), algo, cfg.policy.min_std)

  algo = cfg.algo
  only = {
      'policy': dataclasses.replace(algo, value_cost=0.0, entropy_cost=0.0),
      'policy+value': dataclasses.replace(algo, entropy_cost=0.0),
      'policy+entropy': dataclasses.replace(algo, value_cost=0.0),
  }
  grads = {name: jax.grad(term_loss, has_aux=True)(params.network, a)[0] for name, a in only.items()}
  _, metrics = term_loss(params.network, algo)
  sub = lambda x, y: jax.tree.map(jnp.subtract, x, y)
  terms = {
      'policy': _norms(grads['policy']),
      'value': _norms(sub(grads['policy+value'], grads['policy'])),
      'entropy': _norms(sub(grads['policy+entropy'], grads['policy'])),
  }
  trunk_ratio = terms['value'].get('trunk', 0.0) / terms['policy']['trunk']
  return {
      'critic': critic,
      'num_params': int(sum(x.size for x in jax.tree_util.tree_leaves(params.network))),
      'batch': {
          'steps': int(batch.reward.shape[0]),
          'segments': int(batch.reward.shape[1])
      },
      'losses': {
          k: float(metrics[k]) for k in ('policy_loss', 'value_loss', 'entropy_loss')
      },
      'grad_norm': terms,
      'trunk_value_over_policy': trunk_ratio,
  }


def main(argv) -> None:
  del argv
  cfg = ebrl_main.config_from_flags()
  result = {
      'commit': bench_run.commit(),
      'command': ' '.join(['python', '-m', 'experiments.critic_gradients', *sys.argv[1:]]),
      'machine': bench_run.machine(),
      'runs': [measure(cfg, critic) for critic in ('shared', 'mlp')],
  }
  text = json.dumps(result, indent=1)
  print(text)
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      f.write(text + '\n')


if __name__ == '__main__':
  main(ebrl_main.parse_flags(sys.argv))
