"""One data-parallel trainer rank on fixed synthetic batches (run by tests/trainer/test_data_parallel.py).

  python dp_rank.py OUT.npz --ranks N --rank R --port P [--die_after STEP] [--save_dir DIR]

Every rank builds the same global batches, trains on its own contiguous share of the segments (its "cell's"
batch) and writes its final parameters per case to OUT.npz. With --die_after, rank R kills itself (SIGKILL)
after that step and the others report what `runtime.distributed.failed_rank` names. With --save_dir, rank 0
checkpoints the PPO state after step SAVE_STEP. The last rank votes to stop (SIGTERM's vote) at step VOTE_STEP;
each rank records the vote its steps agreed on (`<case>/agreed`) and times one all-reduce of the parameters' size
(`allreduce_s`, `allreduce_bytes`), runs the fused cells' iterations on stand-in rollouts (`fused/...`) and
rank k > 0 says whether the MJX env it builds is on its own device (`mjx_sys_addressable`).
"""
import argparse
import os
import signal
import time

import jax
import numpy as np

from ebrl_jax.controller import fused_steps
from ebrl_jax.rollout import keys
from ebrl_jax.runtime import distributed
from ebrl_jax.runtime import errors
from ebrl_jax.trainer import checkpoint
from ebrl_jax.trainer import parallel
from ebrl_jax.trainer import ranks

import dp_cases  # pylint: disable=g-bad-import-order

VOTE_STEP = 1


def _mjx_sys_addressable() -> bool:
  """Whether the MJX env this rank builds holds its model on this rank's own device (MJX alone would put it on
  `jax.devices()[0]`, rank 0's: `sim.mjx_env._mjx_on_local_devices`). Builds the env only: no MJX compile."""
  from ebrl_jax.sim import mjx_env  # lazy: brax and MJX (~5 s of imports) load only on a rank that checks them
  env = mjx_env.make_mjx_env('inverted_pendulum', 50, 1, auto_reset=True, impl='jax')
  leaves = [x for x in jax.tree_util.tree_leaves(env.unwrapped.sys) if isinstance(x, jax.Array)]
  return bool(leaves) and all(x.is_fully_addressable for x in leaves)


def _fused_steps(rank, ranks_n, mesh, state):
  """The fused cells' iterations (`fused_steps.run_iterations` around `ranks.RankStep`) on stand-in rollouts: the
  last rank votes to stop at step FUSED_VOTE_STEP; the stop's iteration count and state go to OUT.npz."""
  case = dp_cases.CASES[0]
  algo, train_fn = case.algo, dp_cases.train_fn(case, mesh)  # the PPO case's step, compiled already; its state
  steps = []  # the votes asked for so far: one per step
  asked = lambda: steps.append(1) or ('SIGTERM'
                                      if rank == ranks_n - 1 and len(steps) == dp_cases.FUSED_VOTE_STEP + 1 else None)
  rank_step = ranks.RankStep(train_fn, mesh, ranks.StopVote(asked=asked))
  root = keys.root(0)
  try:
    fused_steps.run_iterations(dp_cases.cell_collect(rank, ranks_n), rank_step, algo.name, root,
                               keys.cell_key(root, rank), state, dp_cases.FUSED_ITERATIONS, rank_step)
  except errors.StopRequested as stop:
    out = {f'fused/{k}': np.asarray(v) for k, v in dp_cases.flat(stop.state.params).items()}
    out['fused/done'], out['fused/reason'] = np.asarray(stop.done), np.asarray(stop.reason)
    out['fused/chain'] = np.asarray(rank_step.chain)
    return out
  raise AssertionError('the ranks did not stop at the voted step')


def main():
  p = argparse.ArgumentParser()
  p.add_argument('out')
  p.add_argument('--ranks', type=int, required=True)
  p.add_argument('--rank', type=int, required=True)
  p.add_argument('--port', type=int, required=True)
  p.add_argument('--die_after', type=int, default=-1)
  p.add_argument('--dying_rank', type=int, default=-1)
  p.add_argument('--save_dir', default='')
  a = p.parse_args()
  spec = distributed.resolve(f'127.0.0.1:{a.port}', a.ranks, a.rank, heartbeat_timeout_s=3)
  distributed.initialize(spec)
  mesh = parallel.rank_mesh()
  out, initial = {}, None
  for case in (dp_cases.CASES if a.die_after < 0 else dp_cases.CASES[:1]):
    state = dp_cases.setup(case)[3]
    initial = state if case.name == 'ppo' else initial  # the step over the ranks donates nothing
    train_fn = dp_cases.train_fn(case, mesh)
    agreed = []
    for step, batch in enumerate(dp_cases.batches(case, state)):
      share = dp_cases.share(batch, a.rank, a.ranks)
      vote = parallel.STOP_REASONS.index('SIGTERM') if (step == VOTE_STEP and a.rank == a.ranks - 1) else 0
      try:
        state, metrics, agreement = train_fn.voting(state, share, jax.random.PRNGKey(100 + step), vote)
        agreed.append(agreement)
        jax.block_until_ready(state)
      except Exception as e:  # pylint: disable=broad-except
        failed = distributed.failed_rank(spec, e)
        print(f'NOTICED {time.time():.3f} {failed}', flush=True)
        distributed.exit_now(3)
      if a.die_after == step and a.rank == a.dying_rank:
        print(f'DYING {time.time():.3f}', flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
      if a.save_dir and a.rank == 0 and case.name == 'ppo' and step + 1 == dp_cases.SAVE_STEP:
        with checkpoint.Checkpointer(a.save_dir) as ckpt:
          ckpt.save(step + 1, state, {'ranks': a.ranks})
    out.update({f'{case.name}/{k}': np.asarray(v) for k, v in dp_cases.flat(state.params).items()})
    out[f'{case.name}/loss'] = np.asarray(metrics['total_loss'])
    out[f'{case.name}/agreed'] = np.asarray(agreed)
  if a.die_after < 0:
    out['allreduce_s'], out['allreduce_bytes'] = parallel.allreduce_seconds(mesh, state.params)
    out.update(_fused_steps(a.rank, a.ranks, mesh, initial))
    out['mjx_sys_addressable'] = _mjx_sys_addressable() if a.rank else True  # rank 0's devices()[0] is its own
    distributed.barrier('dp_rank/mjx', 120)  # rank 0 hosts the coordination service: it leaves after rank 1
  np.savez(a.out, **out)
  print('DONE', flush=True)
  distributed.exit_now(0)  # JAX's shutdown barrier may find rank 0's coordinator gone already: nothing to wait for


if __name__ == '__main__':
  try:
    main()
  except BaseException:  # an error on one rank must not leave the others waiting in an all-reduce
    import traceback  # pylint: disable=g-import-not-at-top
    traceback.print_exc()
    distributed.exit_now(1)
