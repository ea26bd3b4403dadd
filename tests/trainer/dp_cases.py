"""The fixed synthetic cases the data-parallel tests train on (shared by the test and its rank processes)."""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ebrl_jax.config import AlgoConfig, PolicyConfig
from ebrl_jax.generation import policies
from ebrl_jax.generation import stages as gen_stages
from ebrl_jax.rollout import keys
from ebrl_jax.trainer import parallel
from ebrl_jax.trainer import stages
from ebrl_jax.types import EpisodeStats, Transition

OBS, ACT, T, S = 5, 2, 4, 8  # S: the global batch's segments (PPO) or envs (GRPO)
STEPS, SAVE_STEP = 2, 1
MIN_STD = 0.001
NET = policies.make_network(PolicyConfig(policy_hidden_sizes=(16, 16), value_hidden_sizes=(16, 16)), OBS, ACT)


class Case(NamedTuple):
  name: str
  algo: AlgoConfig
  group_size: int = 1


# One minibatch per epoch: the ranks' step is the one-rank step on the concatenated batch (to rounding). The
# entropy estimate draws noise per rank, so the exact comparisons leave it out. With more minibatches each one
# is the union of the ranks' minibatches, a different partition from one rank's: not compared here.
_COMMON = dict(num_updates_per_batch=2, unroll_length=T, max_grad_norm=1.0, learning_rate=3e-3, entropy_cost=0.0)
CASES = (
    Case('ppo', AlgoConfig(batch_size=8, num_minibatches=1, reward_scaling=1.0, **_COMMON)),
    Case('grpo', AlgoConfig(name='grpo', batch_size=8, num_minibatches=1, **_COMMON), group_size=2),
)


def setup(case: Case):
  optimizer = stages.make_optimizer(case.algo)
  state = stages.init_train_state(NET, optimizer, jax.random.PRNGKey(0), OBS)
  return NET, optimizer, case.algo, state


@functools.lru_cache(maxsize=None)
def train_fn(case: Case, mesh):
  """The case's train step over `mesh`'s ranks (one rank: `stages.make_train_fn`'s), built once per process, so
  every use of one case compiles it once."""
  net, optimizer, algo, _ = setup(case)
  return parallel.make_data_parallel_train_fn(net, optimizer, algo, MIN_STD, case.group_size, True, mesh)


@functools.partial(jax.jit, static_argnums=(0,))
def _batch(net, params, key):
  k = jax.random.split(key, 5)
  obs = jax.random.normal(k[0], (T, S, OBS)) * 3.0 + 1.0
  out = gen_stages.act(net, params, obs.reshape(T * S, OBS), k[1])
  # Masks differ between the ranks' halves (rank 1 keeps fewer steps): the means must be over the global batch.
  mask = (jax.random.uniform(k[4], (T, S)) < jnp.where(jnp.arange(S) < S // 2, 0.9, 0.5)).astype(jnp.float32)
  return Transition(obs=obs,
                    raw_action=out.raw_actions.reshape(T, S, 1, ACT),
                    reward=jax.random.normal(k[2], (T, S)),
                    termination=jnp.zeros((T, S)),
                    truncation=(jax.random.uniform(k[3], (T, S)) < 0.1).astype(jnp.float32),
                    next_obs=obs + 0.1,
                    behaviour_log_prob=out.log_probs.reshape(T, S),
                    mask=mask.at[0].set(1.0),
                    policy_version=jnp.zeros((T, S), jnp.int32))


def batches(case: Case, state):
  """STEPS global batches, the same on every rank (acted by the initial parameters)."""
  return [_batch(NET, state.params, jax.random.PRNGKey(1 + i)) for i in range(STEPS)]


def share(batch: Transition, rank: int, ranks: int) -> Transition:
  """Rank `rank`'s contiguous share of the segment axis (axis 1)."""
  n = S // ranks
  return jax.tree_util.tree_map(lambda x: x[:, rank * n:(rank + 1) * n], batch)


def flat(tree):
  return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}


# The fused iterations stepped from Python (controller/fused_steps.py, an MJX or native-MuJoCo cell's loop) over the
# ranks: each cell collects with the current parameters from its own rollout keys (`keys.cell_key`). FUSED_ITERATIONS
# are asked for; the last rank votes to stop at step FUSED_VOTE_STEP, so every rank stops after FUSED_VOTE_STEP + 1.
FUSED_ITERATIONS, FUSED_VOTE_STEP = 3, 1


def cell_collect(rank: int, ranks: int):
  """Cell `rank`'s stand-in rollout: a batch acted by `params` from the cell's rollout key (the iteration is in
  it), its share of the segments (S // ranks) and the episodes it finished (its rewards' sum as one episode's
  return). On the host, through the one compiled `_batch`: nothing else to compile."""

  def collect(params, iteration, key):
    del iteration
    batch = share(jax.device_get(_batch(NET, jax.device_get(params), key)), rank, ranks)
    return batch, EpisodeStats(float(np.sum(batch.reward)), float(T), 1.0)

  return collect


def global_collect(ranks: int, root_key):
  """The one-rank reference's rollout: every cell's batch (from its own keys) concatenated in rank order."""
  cells = [cell_collect(r, ranks) for r in range(ranks)]

  def collect(params, iteration, key):
    del key  # each cell's own
    out = [
        c(params, iteration, keys.rollout_key(keys.cell_key(root_key, r), iteration, 0)) for r, c in enumerate(cells)
    ]
    batch = jax.tree_util.tree_map(lambda *x: np.concatenate(x, axis=1), *[b for b, _ in out])
    stats = jax.tree_util.tree_map(lambda *x: sum(x), *[s for _, s in out])
    return batch, stats

  return collect
