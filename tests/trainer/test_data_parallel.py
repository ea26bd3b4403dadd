"""Data-parallel trainer ranks on jax.distributed (CPU, gloo): 2 ranks reach the parameters of 1 rank on the same
global batch (PPO and GRPO) and hold identical parameters, learn one rank's stop vote from the step it rode on
(`voting`) and time an all-reduce of the parameters' size (`allreduce_seconds`); the fused cells' iterations
(`controller.fused_steps`, an MJX or native-MuJoCo cell's loop) over 2 ranks, each cell collecting its own stand-in
rollouts, stop together at one rank's vote and match one rank on the cells' batches; rank 1 builds its MJX env on
its own device, not rank 0's (`jax.devices()[0]`); a checkpoint written by rank 0
of 2 resumes on 1 rank; killing a rank stops the other with a message naming it. The ranks are subprocesses
running tests/trainer/dp_rank.py.
"""
import os
import re
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from ebrl_jax.controller import fused_steps
from ebrl_jax.rollout import keys
from ebrl_jax.trainer import checkpoint
from ebrl_jax.trainer import parallel

import dp_cases  # pylint: disable=g-bad-import-order

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _ranks(tmp_path, n, *extra, timeout=120):
  """Runs n rank processes to the end; returns their (returncode, stdout) and output files."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]), JAX_PLATFORMS='cpu')
  port = _port()
  outs = [str(tmp_path / f'rank{r}.npz') for r in range(n)]
  procs = [
      subprocess.Popen([
          sys.executable,
          os.path.join(HERE, 'dp_rank.py'), outs[r], '--ranks',
          str(n), '--rank',
          str(r), '--port',
          str(port), *(extra if r == 0 or '--save_dir' not in extra else ())
      ],
                       env=env,
                       stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT,
                       text=True) for r in range(n)
  ]
  results = [p.communicate(timeout=timeout) for p in procs]
  return [(p.returncode, out) for p, (out, _) in zip(procs, results)], outs


def _one_rank():
  """The one-rank reference, in this process: `parallel` on a one-device mesh is `stages.make_train_fn`."""
  out = {}
  for case in dp_cases.CASES:
    state = dp_cases.setup(case)[3]
    train_fn = dp_cases.train_fn(case, parallel.rank_mesh())
    for step, batch in enumerate(dp_cases.batches(case, state)):
      state, _ = train_fn(state, batch, jax.random.PRNGKey(100 + step))
    out[case.name] = dp_cases.flat(state.params)
  return out


def _check_fused_steps(ranks):
  """The fused cells' iterations over the ranks (`fused_steps.run_iterations` around `RankStep`, each cell
  collecting its own stand-in rollouts with the current parameters) stopped together after the voted step, and
  hold one rank's parameters trained on the cells' batches concatenated, iteration by iteration."""
  done = dp_cases.FUSED_VOTE_STEP + 1
  for r in ranks:
    assert (int(r['fused/done']), str(r['fused/reason'])) == (done, 'SIGTERM')
  assert str(ranks[0]['fused/chain']) == str(ranks[1]['fused/chain']), 'the ranks held different parameters'
  case = dp_cases.CASES[0]
  _, _, algo, state = dp_cases.setup(case)
  train_fn = dp_cases.train_fn(case, parallel.rank_mesh())  # one rank: `stages.make_train_fn`'s step
  root = keys.root(0)
  state, _ = fused_steps.run_iterations(dp_cases.global_collect(len(ranks), root), train_fn, algo.name, root, root,
                                        state, done)
  for name, want in dp_cases.flat(state.params).items():
    got = [r[f'fused/{name}'] for r in ranks]
    np.testing.assert_array_equal(got[0], got[1], err_msg=f'fused {name}: the ranks differ')
    np.testing.assert_allclose(got[0], np.asarray(want), rtol=2e-4, atol=2e-5, err_msg=f'fused {name}')


def test_two_ranks_match_one_rank_and_resume_on_one(tmp_path):
  save_dir = str(tmp_path / 'checkpoints')
  results, outs = _ranks(tmp_path, 2, '--save_dir', save_dir)
  for rc, log in results:
    assert rc == 0, log[-3000:]
  reference = _one_rank()
  ranks = [np.load(o) for o in outs]
  for case in dp_cases.CASES:
    for name, want in reference[case.name].items():
      got = [r[f'{case.name}/{name}'] for r in ranks]
      np.testing.assert_array_equal(got[0], got[1], err_msg=f'{case.name} {name}: the ranks differ')
      np.testing.assert_allclose(got[0], np.asarray(want), rtol=2e-4, atol=2e-5, err_msg=f'{case.name} {name}')
    # Rank 1 alone voted to stop at step VOTE_STEP: both ranks learned it from that step, and only from it.
    want = [
        parallel.STOP_REASONS.index('SIGTERM') if s == 1 else 0 for s in range(len(ranks[0][f'{case.name}/agreed']))
    ]
    assert [list(r[f'{case.name}/agreed']) for r in ranks] == [want, want]
  _check_fused_steps(ranks)
  assert bool(ranks[1]['mjx_sys_addressable']), 'rank 1 built its MJX env on another rank\'s device'
  nbytes = sum(4 * np.size(v) for v in reference['grpo'].values())  # float32, every leaf of the parameters
  for r in ranks:  # one all-reduce of the gradients' size, timed alone over the 2 ranks (gloo)
    assert 0 < float(r['allreduce_s']) < 5 and int(r['allreduce_bytes']) == nbytes, (r['allreduce_s'], nbytes)
  # Rank 0 of 2 checkpointed PPO after SAVE_STEP steps; one rank resumes there and finishes the run.
  case = dp_cases.CASES[0]
  template = dp_cases.setup(case)[3]
  with checkpoint.Checkpointer(save_dir) as ckpt:
    assert ckpt.all_steps() == (dp_cases.SAVE_STEP,)
    state, extra, _ = ckpt.restore(template)
  assert extra == {'ranks': 2}
  train_fn = dp_cases.train_fn(case, parallel.rank_mesh())
  for step, batch in enumerate(dp_cases.batches(case, template)):
    if step >= dp_cases.SAVE_STEP:
      state, _ = train_fn(state, batch, jax.random.PRNGKey(100 + step))
  for name, value in dp_cases.flat(state.params).items():
    np.testing.assert_allclose(np.asarray(value), reference['ppo'][name], rtol=2e-4, atol=2e-5, err_msg=name)


def test_a_killed_rank_stops_the_other_naming_it(tmp_path):
  results, _ = _ranks(tmp_path, 2, '--die_after', '0', '--dying_rank', '1')
  (rc0, log0), (rc1, log1) = results
  assert rc1 == -9 and 'DYING' in log1, log1[-2000:]
  assert rc0 == 3, log0[-3000:]
  noticed = re.search(r'NOTICED ([\d.]+) (.*)', log0)
  assert noticed, log0[-3000:]
  assert 'trainer rank 1 (' in noticed.group(2) and socket.gethostname() in noticed.group(2), noticed.group(2)
  died = float(re.search(r'DYING ([\d.]+)', log1).group(1))
  seconds = float(noticed.group(1)) - died
  print(f'rank 0 named the dead rank {seconds:.1f} s after it died: {noticed.group(2)}')
  assert seconds < 30  # the heartbeat timeout is 3 s; the all-reduce fails at once
