"""Env slices (`--env_slices`): the generation worker batches whichever slices of any group are ready, padded to
a bucket, and replies to each slice; a sliced collector writes the same segment layout as an unsliced one."""
import threading
from typing import NamedTuple

import numpy as np
import pytest
import runs_testlib  # pylint: disable=g-bad-import-order

from ebrl_jax import config as config_lib
from ebrl_jax import controller
from ebrl_jax import transport
from ebrl_jax import types
from ebrl_jax.controller import topology
from ebrl_jax.generation import batching
from ebrl_jax.generation import worker as generation_worker
from ebrl_jax.rollout import cpu as cpu_rollout
from ebrl_jax.rollout import groups
from ebrl_jax.sim import cpu_env
from ebrl_jax.sim import registry

GROUPS, SLICES, M, O, A = 2, 2, 4, 3, 2  # 2 groups of 2 slices of 4 envs; obs dim 3, action dim 2


def test_buckets_are_the_slice_size_times_powers_of_two_up_to_all_envs():
  assert batching.make_buckets(8, 64) == (8, 16, 32, 64)
  assert batching.make_buckets(32, 96) == (32, 64, 96)  # 3 groups, no slices: 3 ready groups fill 96
  assert batching.make_buckets(32, 64) == (32, 64)  # 2 groups, no slices: the sizes batched before slices
  assert batching.make_buckets(4, 4) == (4,)
  # 5 ready slices of 8 envs (40 rows) pad to 64; 2 to 16.
  assert batching.bucket_for((8, 16, 32, 64), 40) == 64 and batching.bucket_for((8, 16, 32, 64), 16) == 16
  with pytest.raises(ValueError, match='exceeds the largest bucket 64'):
    batching.bucket_for((8, 16, 32, 64), 72)
  with pytest.raises(ValueError, match='must be > 0 and divide total_envs=64'):
    batching.make_buckets(12, 64)
  out = np.full((8, 2), 7.0, np.float32)
  batching.pack([np.ones((2, 2)), 2 * np.ones((2, 2))], out)
  np.testing.assert_array_equal(out[:, 0], [1, 1, 2, 2, 0, 0, 0, 0])  # padding rows zeroed


class _Out(NamedTuple):
  actions: np.ndarray
  raw_actions: np.ndarray
  log_probs: np.ndarray


class _FakeAct:
  """actions = the first A obs values, log_probs = the obs's first value: a reply shows whose obs it answers."""

  def __init__(self):
    self.shapes = []

  def __call__(self, params, obs, key, index):
    del params, key, index
    self.shapes.append(obs.shape)
    obs = np.array(obs)
    return _Out(actions=obs[:, None, :A], raw_actions=2 * obs[:, None, :A], log_probs=obs[:, 0])


def _mailbox():
  cfg = config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum', num_envs=GROUPS * SLICES * M),
                          algo=config_lib.AlgoConfig(batch_size=16, num_minibatches=1),
                          schedule=config_lib.ScheduleConfig(name='async',
                                                             num_groups=GROUPS,
                                                             colocate_generation=False,
                                                             env_slices=SLICES))
  spec = types.EnvSpec('fake', O, A, 100, 0.01)
  request_spec, reply_spec = topology.mailbox_specs(cfg, spec)
  return transport.make_mailbox('thread', request_spec, reply_spec, GROUPS, num_slices=SLICES, slice_field='env_slice')


def _obs(group, env_slice):
  """[M, O]: value 10 * group + env_slice + row / 100 (row = env within the slice)."""
  return (10 * group + env_slice + np.arange(M)[:, None] / 100 + np.zeros((M, O))).astype(np.float32)


def _request(group, env_slice, seq=1, min_version=0):
  return types.ActRequest(group=np.int32(group),
                          env_slice=np.int32(env_slice),
                          seq=np.int32(seq),
                          min_version=np.int32(min_version),
                          obs=_obs(group, env_slice),
                          key=np.zeros((2,), np.uint32),
                          owner=np.int32(0),
                          handle=np.zeros((64,), np.uint8))


def test_server_batches_ready_slices_of_any_group_pads_to_a_bucket_and_replies_to_each_slice():
  mailbox, act = _mailbox(), _FakeAct()
  server = generation_worker.ActServer(mailbox, act, M, GROUPS * SLICES * M, O, reply_timeout_s=0.05)
  assert server.buckets == (4, 8, 16)
  # Three slices of two groups are ready; (0, 0) is still stepping its physics.
  ready = [(0, 1), (1, 0), (1, 1)]
  for group, env_slice in ready:
    mailbox.ask(_request(group, env_slice, seq=5 + group))
  requests = mailbox.gather(GROUPS * SLICES, timeout=1)
  assert [(g, mailbox.slice_of(r)) for g, r in requests] == ready
  assert server.serve(requests, params=None, version=3, key=None, index=0) == 16  # 12 rows padded to 16
  assert act.shapes == [(16, O)]
  for group, env_slice in reversed(ready):
    reply = mailbox.receive(group, timeout=1, env_slice=env_slice)
    assert (int(reply.group), int(reply.env_slice), int(reply.seq), int(reply.version)) == (group, env_slice, 5 + group,
                                                                                            3)
    np.testing.assert_array_equal(reply.actions[:, 0], _obs(group, env_slice)[:, :A])
    np.testing.assert_array_equal(reply.log_probs, _obs(group, env_slice)[:, 0])
  # Then one slice alone: the smallest bucket, no padding.
  mailbox.ask(_request(0, 0))
  assert server.serve(mailbox.gather(4, timeout=1), None, 4, None, 1) == 4
  np.testing.assert_array_equal(mailbox.receive(0, timeout=1, env_slice=0).actions[:, 0], _obs(0, 0)[:, :A])
  stats = server.stats()
  assert stats['requests_per_batch'] == {'1': 1, '3': 1} and stats['batches_per_bucket'] == {'4': 1, '16': 1}
  assert (stats['rows'], stats['padded_rows'], stats['dropped_replies']) == (16, 4, 0)


def test_reply_to_a_dead_slice_is_dropped_and_its_restarted_worker_gets_its_own():
  mailbox, act = _mailbox(), _FakeAct()
  server = generation_worker.ActServer(mailbox, act, M, GROUPS * SLICES * M, O, reply_timeout_s=0.2)
  # Group 1's worker asked twice for slice 1 (seq 7, then re-sent) and died: nobody reads its replies.
  for _ in range(2):
    mailbox.ask(_request(1, 1, seq=7))
  for _ in range(2):
    server.serve(mailbox.gather(1, timeout=1), None, 0, None, 0)
  assert server.dropped_replies == 1  # the first reply fills the slice's channel, the second times out
  # Its replacement (a new incarnation, seq from 1) skips the stale reply and gets the answer to its own request.
  stop = threading.Event()
  serving = threading.Thread(target=lambda: server.serve(mailbox.gather(1, timeout=5), None, 1, None, 0))
  serving.start()
  remote = groups.RemoteAct(mailbox, 1, stop, env_slice=1)
  reply = remote(None, _obs(1, 1) + 0.5, None, 0)
  serving.join(5)
  assert (int(reply.seq), int(reply.version)) == (1, 1)
  np.testing.assert_array_equal(reply.actions[:, 0], (_obs(1, 1) + 0.5)[:, :A])


class _Versioned(NamedTuple):
  actions: np.ndarray
  raw_actions: np.ndarray
  log_probs: np.ndarray
  version: int


def _slice_act(version):
  """A stand-in remote act: zero actions, log-prob = -version, reporting `version` (per slice)."""

  def act(params, obs, key, index):
    del params, key, index
    n = obs.shape[0]
    return _Versioned(np.zeros((n, 1, 1)), np.zeros((n, 1, 1)), np.full((n,), -version, np.float32), version)

  return act


def test_sliced_collector_writes_the_unsliced_layout_with_per_slice_versions():
  spec = registry.env_spec('inverted_pendulum', 30)
  segments = {}
  for slices in (1, 4):
    # Episodic (frozen finished envs, resets only at the start): the trajectories do not depend on timing.
    with cpu_env.CpuEnvPool('inverted_pendulum', 8, 30, num_threads=2, seed=3, auto_reset=False) as pool:
      acts = [_slice_act(10 + s) for s in range(slices)]
      collector = cpu_rollout.CpuCollector(pool, spec, acts if slices > 1 else acts[0], 1, 30, 1, episodic=True)
      segments[slices] = collector.collect(None, 0, None)
      collector.close()
  (whole, whole_stats), (sliced, sliced_stats) = segments[1], segments[4]
  for field in ('obs', 'next_obs', 'reward', 'termination', 'truncation', 'mask'):
    np.testing.assert_array_equal(getattr(sliced, field), getattr(whole, field), err_msg=field)
  assert sliced_stats == whole_stats
  # Envs 2s and 2s+1 form slice s: their actions came back with version 10 + s.
  np.testing.assert_array_equal(sliced.policy_version[0], [10, 10, 11, 11, 12, 12, 13, 13])
  np.testing.assert_array_equal(sliced.behaviour_log_prob[-1], -sliced.policy_version[-1])


def test_async_with_env_slices_learns_without_losing_or_duplicating_segments(tmp_path):
  cfg = config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum',
                                                   num_envs=32,
                                                   num_eval_envs=8,
                                                   num_threads=1),
                          algo=config_lib.AlgoConfig(batch_size=32, num_minibatches=8),
                          schedule=config_lib.ScheduleConfig(name='async',
                                                             num_timesteps=25_600,
                                                             num_evals=2,
                                                             run_dir=str(tmp_path),
                                                             compilation_cache_dir='',
                                                             progress_bar=False,
                                                             transport='shm',
                                                             num_groups=2,
                                                             max_staleness=1,
                                                             colocate_generation=False,
                                                             env_slices=2))
  summary = controller.run(cfg)
  # 20 iterations x 2 groups, each segment whole (both slices) and seen once; none staler than the bound.
  extra = runs_testlib.assert_each_segment_once(summary, 25_600, 40, max_staleness=1)
  assert summary.best_eval_return > 2 * summary.eval_curve[0]['return']
  gen = extra['generation']
  # A reply may find its slice's worker gone when the run stops: at most one outstanding request per slice (2
  # groups x 2 slices); under load 1-2 were seen (3 of 5 runs), every segment still whole and seen once.
  assert gen['slice_envs'] == 8 and gen['buckets'] == [8, 16, 32] and gen['dropped_replies'] <= 4
  requests = sum(int(k) * v for k, v in gen['requests_per_batch'].items())
  assert set(gen['requests_per_batch']) <= {'1', '2', '3', '4'} and gen['rows'] == 8 * requests
  # Every slice asked for 40 policy steps per iteration (8 unrolls of 5), for at least the 20 iterations trained.
  assert requests >= 20 * 2 * 2 * 40
