"""`--schedule=overlap` on native MuJoCo: sync's evaluation curve bit for bit (PPO and GRPO, two env groups), with
its windows run; the iteration graph is in the summary. The MJX backend: test_overlap_mjx.py."""
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax import controller


def _config(run_dir, cache, schedule, algo, backend='mujoco_cpu', num_timesteps=None, evaluator='process'):
  grpo = algo == 'grpo'
  steps = num_timesteps or (2 * 32 * 40 if grpo else 3 * 16 * 4 * 5)
  return config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum',
                                                    backend=backend,
                                                    num_envs=32,
                                                    num_eval_envs=4,
                                                    num_threads=1,
                                                    episode_length=40,
                                                    group_size=4 if grpo else 1),
                           policy=config_lib.PolicyConfig(policy_hidden_sizes=(16, 16), value_hidden_sizes=(32, 32)),
                           algo=config_lib.AlgoConfig(name=algo, batch_size=16, num_minibatches=4),
                           schedule=config_lib.ScheduleConfig(name=schedule,
                                                              run_dir=str(run_dir / schedule),
                                                              compilation_cache_dir=str(cache),
                                                              progress_bar=False,
                                                              transport='thread',
                                                              num_groups=2,
                                                              num_timesteps=steps,
                                                              num_evals=3,
                                                              evaluator=evaluator))


def check_overlap_replays_sync(tmp_path, algo, backend='mujoco_cpu', switches=None, evaluator='process'):
  """Runs sync, then overlap (sharing a compilation cache, so overlap loads sync's programs) and compares."""
  runs = {
      s: controller.run(_config(tmp_path, tmp_path / 'xla', s, algo, backend, evaluator=evaluator))
      for s in ('sync', 'overlap')
  }
  sync, overlap = runs['sync'], runs['overlap']
  assert [e['return'] for e in overlap.eval_curve] == [e['return'] for e in sync.eval_curve]
  assert [e['env_steps'] for e in overlap.eval_curve] == [e['env_steps'] for e in sync.eval_curve]
  assert len(sync.eval_curve) >= 3 and overlap.env_steps == sync.env_steps
  assert overlap.extra['segments_consumed'] == sync.extra['segments_consumed']
  graph = overlap.extra['iteration_graph']
  assert graph['schedule'] == 'overlap' and sync.extra['iteration_graph']['realised'] == []
  if switches is not None:
    assert graph['realised'] == switches
  return sync, overlap


@pytest.mark.parametrize('algo,evaluator,switches',
                         [('ppo', 'process', ['checkpoint', 'h2d']),
                          ('ppo', 'trainer', ['checkpoint', 'evaluate', 'h2d']),
                          ('grpo', 'trainer', ['checkpoint', 'evaluate', 'h2d', 'reset_next'])])
def test_overlap_replays_sync_bit_for_bit_on_native_mujoco(tmp_path, algo, evaluator, switches):
  """With the evaluator process (the default) both schedules evaluate there and the graph has no 'evaluate'
  window; with --evaluator=trainer overlap evaluates in its window, a thread of the trainer."""
  sync, overlap = check_overlap_replays_sync(tmp_path, algo, switches=switches, evaluator=evaluator)
  graph = overlap.extra['iteration_graph']
  evaluate = next(t for t in graph['tasks'] if t['name'] == 'evaluate')
  assert evaluate['process'] == ('evaluator' if evaluator == 'process' else 'trainer')
  assert ('evaluator' in overlap.extra) == (evaluator == 'process'), sorted(overlap.extra)
