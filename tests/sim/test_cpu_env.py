"""Contract tests of the native-MuJoCo pool: groups, episode bookkeeping, chunks, subsets, threads."""
import re

import numpy as np
import pytest

from ebrl_jax import config
from ebrl_jax.sim import cpu_env
from ebrl_jax.sim import registry


def _pool(task='inverted_pendulum', num_envs=4, episode_length=1000, **kw):
  kw.setdefault('num_threads', 1)
  return cpu_env.CpuEnvPool(task, num_envs, episode_length, **kw)


@pytest.mark.parametrize('task', config.TASKS)
def test_every_task_resets_and_steps(task):
  spec = registry.env_spec(task, 1000, 1)
  with _pool(task, num_envs=3) as pool:
    obs = pool.reset()
    assert obs.shape == (3, spec.obs_dim) and obs.dtype == np.float32
    actions = np.random.default_rng(0).uniform(-1, 1, (3, 2, spec.action_dim))
    res = pool.step(actions)
    assert res.obs.shape == (3, spec.obs_dim)
    for field in ('reward', 'done', 'truncation', 'episode_return', 'episode_length'):
      assert getattr(res, field).shape == (3,), field
    assert np.all(np.isfinite(res.obs)) and np.all(np.isfinite(res.reward))
    assert pool.model.nu == spec.action_dim


def test_groups_share_the_initial_state_and_groups_differ():
  with _pool(num_envs=6, group_size=2, seed=3) as pool:
    qpos, qvel = pool.get_state()
    for g in range(3):
      np.testing.assert_array_equal(qpos[2 * g], qpos[2 * g + 1])
      np.testing.assert_array_equal(qvel[2 * g], qvel[2 * g + 1])
    assert not np.allclose(qpos[0], qpos[2]) and not np.allclose(qpos[2], qpos[4])
    # A partial reset redraws per group as well.
    obs = pool.reset([2, 3])
    np.testing.assert_array_equal(obs[0], obs[1])
    assert not np.allclose(pool.get_state([2])[0], qpos[2])


def test_seed_makes_resets_reproducible():
  with _pool(seed=7) as a, _pool(seed=7) as b, _pool(seed=8) as c:
    np.testing.assert_array_equal(a.get_state()[0], b.get_state()[0])
    assert not np.allclose(a.get_state()[0], c.get_state()[0])


def test_time_limit_truncates_reports_totals_and_auto_resets():
  # Inverted pendulum, zero force: starting within 0.01 rad it needs ~13 steps (0.5 s, growth rate
  # sqrt(g / l) ~ 5.7/s) to pass 0.2 rad, so an episode of 5 steps ends by the time limit.
  with _pool(num_envs=2, episode_length=5) as pool:
    total = np.zeros(2)
    for t in range(5):
      res = pool.step(np.zeros((2, 1)))
      total += res.reward
      if t < 4:
        assert not res.done.any()
    np.testing.assert_array_equal(res.done, [1, 1])
    np.testing.assert_array_equal(res.truncation, [1, 1])
    np.testing.assert_allclose(res.episode_return, total)  # 5 x reward 1.0
    np.testing.assert_array_equal(res.episode_length, [5, 5])
    # The obs is a fresh reset obs: qpos and qvel within Brax's U(-0.01, 0.01) reset noise.
    assert np.all(np.abs(res.obs) <= 0.01)
    res = pool.step(np.zeros((2, 1)))
    assert not res.done.any() and np.all(res.episode_length == 1)


def test_action_repeat_counts_brax_steps():
  with _pool(num_envs=1, episode_length=6, action_repeat=2) as pool:
    assert pool.spec.dt == pytest.approx(0.02 * 2 * 2)  # timestep x n_frames x action_repeat
    res = [pool.step(np.zeros((1, 1))) for _ in range(3)]
    assert [r.done[0] for r in res] == [0, 0, 1]
    assert res[-1].episode_length[0] == 6 and res[-1].episode_return[0] == pytest.approx(6.0)


def test_failure_is_done_without_truncation():
  with _pool(num_envs=1) as pool:
    for _ in range(100):
      res = pool.step(np.ones((1, 1)))  # full force to one side tips the pole over
      if res.done[0]:
        break
    assert res.done[0] == 1 and res.truncation[0] == 0 and res.episode_length[0] < 100


def test_chunk_of_one_equals_step_and_chunk_stops_at_first_done():
  actions = np.random.default_rng(1).uniform(-0.2, 0.2, (2, 1))
  with _pool(num_envs=2, episode_length=5, seed=4) as a, _pool(num_envs=2, episode_length=5, seed=4) as b:
    ra, rb = a.step(actions), b.step(actions[:, None])
    for x, y in zip(ra, rb):
      np.testing.assert_array_equal(x, y)
    # Steps 2-4 of the episode, then a chunk of 3 that ends the episode at its 2nd step.
    for _ in range(3):
      a.step(np.zeros((2, 1)))
    b.step(np.zeros((2, 3, 1)))
    rb = b.step(np.zeros((2, 3, 1)))
    ra = a.step(np.zeros((2, 1)))
    np.testing.assert_array_equal(rb.done, [1, 1])
    np.testing.assert_array_equal(rb.truncation, [1, 1])
    np.testing.assert_allclose(rb.reward, [1.0, 1.0])  # only the step that ended the episode counts
    np.testing.assert_array_equal(rb.episode_length, [5, 5])
    np.testing.assert_allclose(rb.episode_return, [5.0, 5.0])
    # The env did not run on after the done: b is at a fresh reset, like a after its 5th step.
    assert np.all(np.abs(rb.obs) <= 0.01)
    np.testing.assert_array_equal(b.step(np.zeros((2, 1))).episode_length, [1, 1])


def test_without_auto_reset_finished_envs_stay_frozen():
  with _pool(num_envs=2, episode_length=3, auto_reset=False) as pool:
    for _ in range(3):
      last = pool.step(np.zeros((2, 1)))
    state = pool.get_state()
    res = pool.step(np.zeros((2, 2, 1)))
    np.testing.assert_array_equal(res.obs, last.obs)
    np.testing.assert_array_equal(res.reward, [0, 0])
    np.testing.assert_array_equal(res.done, [1, 1])
    np.testing.assert_array_equal(res.truncation, [1, 1])
    np.testing.assert_allclose(res.episode_return, [3.0, 3.0])
    np.testing.assert_array_equal(res.episode_length, [3, 3])
    np.testing.assert_array_equal(pool.get_state()[0], state[0])
    pool.reset()
    assert not pool.step(np.zeros((2, 1))).done.any()


def test_subset_step_leaves_other_envs_untouched():
  with _pool('hopper', num_envs=4) as pool:
    before = pool.get_state()
    res = pool.step(np.full((2, 3), 0.5), env_ids=[3, 1])
    assert res.obs.shape == (2, 11)
    after = pool.get_state()
    for i in (0, 2):
      np.testing.assert_array_equal(after[0][i], before[0][i])
      np.testing.assert_array_equal(after[1][i], before[1][i])
    for i in (1, 3):
      assert not np.allclose(after[1][i], before[1][i])
    with pytest.raises(ValueError, match='env_ids'):
      pool.step(np.zeros((1, 3)), env_ids=[4])


def test_threads_give_the_same_results_as_one_thread():
  rng = np.random.default_rng(2)
  actions = rng.uniform(-1, 1, (12, 30, 2, 8))
  ids = [[0, 1, 2, 3, 4, 5, 6, 7], [1, 3, 5, 7, 9, 11, 0, 2], [8, 9, 10, 11, 0, 1, 2, 3]]
  results = []
  for threads in (1, 2):
    with _pool('ant', num_envs=12, episode_length=20, num_threads=threads, seed=5) as pool:
      out = []
      for t in range(30):
        sub = ids[t % 3]
        out.append(pool.step(actions[sub, t], env_ids=sub))
      results.append((out, pool.get_state()))
  for ra, rb in zip(results[0][0], results[1][0]):
    for x, y in zip(ra, rb):
      np.testing.assert_array_equal(x, y)
  np.testing.assert_array_equal(results[0][1][0], results[1][1][0])


def test_invalid_arguments_name_the_field():
  with pytest.raises(ValueError, match='group_size'):
    _pool(num_envs=5, group_size=2)
  with pytest.raises(ValueError, match='episode_length'):
    _pool(episode_length=0)
  with pytest.raises(ValueError, match='Unknown task'):
    _pool('cartpole')


def test_wrongly_shaped_actions_and_states_are_refused_naming_both_shapes():
  """Before the fix an [n] action vector raised IndexError, an [n, 1, A, 1] array a broadcast error from inside the
  physics, an empty chunk [n, 0, A] stepped nothing without a word, and set_state reshaped a transposed qpos."""
  with _pool(num_envs=3) as pool:  # inverted_pendulum: A = 1, nq = nv = 2
    a = pool.spec.action_dim
    for shape in ((3,), (3, 1, a, 1), (3, 0, a), (2, a), (3, a + 1), ()):
      words = f'actions must be [num_envs, action_size] = (3, {a}) or a chunk'
      with pytest.raises(ValueError, match=re.escape(words) + '.*' + re.escape(f'got shape {shape}.')):
        pool.step(np.zeros(shape))
    with pytest.raises(ValueError, match=re.escape(f'= (1, {a})')):  # one env stepped: one row
      pool.step(np.zeros((3, a)), env_ids=[0])
    qpos, qvel = pool.get_state()
    with pytest.raises(ValueError,
                       match=re.escape(f'qpos must be [len(env_ids), nq] = (3, {qpos.shape[1]}); got '
                                       f'shape {qpos.T.shape}.')):
      pool.set_state(range(3), qpos.T, qvel)
    assert pool.step(np.zeros((3, a))).obs.shape == (3, pool.spec.obs_dim)  # the right shapes still step


def test_a_pool_past_the_hosts_available_memory_is_refused_naming_num_envs(monkeypatch):
  # Measured on the first envs, before the rest are made: a billion envs would grow the process until the kernel's
  # OOM killer ended it (seen: a fused run killed at 24 GB resident, no message); this refusal takes a second.
  with pytest.raises(ValueError,
                     match=r'--num_envs: 1,000,000,000 native MuJoCo envs of inverted_pendulum would '
                     r'take about [\d,.]+ GiB of host memory \([\d,]+ KiB each, measured on 64\), more than the'):
    _pool(num_envs=10**9)
  # A machine with 1 KiB to spare (each env takes at least its MjData's buffer, 13 KiB here, measured or not: in a
  # process that freed memory before, new envs may reuse it and add nothing resident)
  monkeypatch.setattr(cpu_env, 'available_host_bytes', lambda: 1024)
  with pytest.raises(ValueError, match='lower --num_envs'):
    _pool(num_envs=4)
  monkeypatch.setattr(cpu_env, 'available_host_bytes', lambda: None)  # unknown (no /proc): no check
  with _pool(num_envs=4) as pool:
    assert pool.reset().shape[0] == 4


def test_an_env_whose_simulation_blows_up_ends_its_episode_as_a_failure_and_resets():
  # NaN velocities in env 0: MuJoCo's step warns and resets that env's data itself, so the frame after it is not
  # the episode's and a reward across it would be made up; the pool ends the episode as a failure, reward 0, and
  # draws a fresh initial state, as MJX's envs do (test_mjx_stages). The other envs step as before.
  with _pool(num_envs=3, seed=4) as pool, _pool(num_envs=3, seed=4) as twin:
    pool.reset(), twin.reset()
    pool._datas[0].qvel[:] = np.nan  # pylint: disable=protected-access
    res, clean = pool.step(np.zeros((3, 1))), twin.step(np.zeros((3, 1)))
    np.testing.assert_array_equal(res.done, [1, 0, 0])
    np.testing.assert_array_equal(res.truncation, [0, 0, 0])
    assert res.reward[0] == 0 and res.episode_return[0] == 0 and res.episode_length[0] == 1
    assert np.isfinite(res.obs).all()
    for field in ('obs', 'reward', 'done'):
      np.testing.assert_array_equal(getattr(res, field)[1:], getattr(clean, field)[1:])
    res = pool.step(np.zeros((3, 1)))  # env 0 on its new episode, its warnings counted afresh
    assert res.done[0] == 0 and res.reward[0] == 1 and res.episode_length[0] == 1
