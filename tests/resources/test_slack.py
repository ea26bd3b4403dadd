"""Slack-aware quotas on synthetic timelines: critical path, slack, the proposal and the keep/revert loop."""
import pytest

from ebrl_jax.resources import slack

# A sync iteration with two groups: group 1 simulates longer, the trainer waits for both, then trains.
DEPS = {'h2d/0': ['collect/0'], 'h2d/1': ['collect/1'], 'train': ['h2d/0', 'h2d/1'], 'evaluate': ['train']}


def _timeline(c0=1.0, c1=3.0, train=2.0, evaluate=0.5):
  return [
      slack.Span('collect/0', 'rollout/0', 0.0, c0),
      slack.Span('collect/1', 'rollout/1', 0.0, c1),
      slack.Span('h2d/0', 'trainer', c0, c0 + 0.1),
      slack.Span('h2d/1', 'trainer', c1, c1 + 0.1),
      slack.Span('train', 'trainer', c1 + 0.1, c1 + 0.1 + train),
      slack.Span('evaluate', 'evaluator', c1 + 0.1 + train, c1 + 0.1 + train + evaluate),
  ]


def test_critical_path_and_slack_by_hand():
  a = slack.analyse(_timeline(), DEPS)
  assert a.makespan == pytest.approx(5.6)
  assert a.critical_path == ('collect/1', 'h2d/1', 'train', 'evaluate')
  # h2d/0 runs on the trainer before h2d/1, so it must end by 3.0, and collect/0 by 2.9.
  assert a.slack['collect/0'] == pytest.approx(1.9)
  assert a.slack['h2d/0'] == pytest.approx(1.9)
  assert a.role_slack == pytest.approx({'rollout': 0.0, 'trainer': 0.0, 'evaluator': 0.0})
  assert a.role_critical_s['trainer'] == pytest.approx(2.1)


def test_a_process_runs_its_tasks_in_turn():
  """Without data edges, two tasks of one process still follow one another: the second waits for the first."""
  a = slack.analyse([slack.Span('a', 'p', 0.0, 1.0), slack.Span('b', 'p', 1.0, 3.0), slack.Span('c', 'q', 0, 1)])
  assert a.critical_path == ('a', 'b') and a.slack['c'] == pytest.approx(2.0) and a.makespan == pytest.approx(3.0)


def test_proposal_moves_quota_from_the_role_with_slack_to_the_critical_one():
  # The evaluator runs beside training (no edge to it): it has slack, the trainer holds the critical path.
  timeline = [
      slack.Span('collect/0', 'rollout/0', 0, 1.0),
      slack.Span('train', 'trainer', 1.0, 4.0),
      slack.Span('evaluate', 'generation', 1.0, 1.5)
  ]
  a = slack.analyse(timeline, {'train': ['collect/0']})
  quotas = {'rollout': 50, 'trainer': 50, 'generation': 40}
  candidate, why = slack.propose(quotas, a, frozenset(quotas), step=10)
  assert candidate == {'rollout': 50, 'trainer': 60, 'generation': 30}
  assert 'generation has 2.500 s of slack' in why and 'trainer 50 -> 60' in why
  # Only the rollout quota changes live: nothing with slack to take from, but the collect runs alone.
  grown, why = slack.propose(quotas, a, frozenset({'rollout'}), step=10)
  assert grown == {'rollout': 60, 'trainer': 50, 'generation': 40} and 'nothing beside it' in why


def _trial_timeline():
  return [
      slack.Span('collect/0', 'rollout/0', 0, 1.0),
      slack.Span('evaluate', 'rollout/1', 0, 0.2),
      slack.Span('train', 'trainer', 1.0, 2.0)
  ]


def test_tuner_keeps_a_candidate_that_is_faster_and_reverts_one_that_is_not():
  tuner = slack.SlackTuner({'rollout': 100, 'trainer': 50}, ['rollout'], step=10, trial_iterations=3)
  timeline = [slack.Span('collect/0', 'rollout/0', 0, 1.0), slack.Span('side', 'rollout/1', 0, 0.2)]
  # rollout/1's side task has slack, but rollout/0 (same role) is critical, and already at 100 %.
  decisions = [tuner.step(i, 2.0, timeline) for i in range(3)]
  assert decisions[:2] == [None, None] and decisions[2].action == 'hold' and tuner.done
  assert 'no quota role has slack' in decisions[2].reason

  tuner = slack.SlackTuner({'rollout': 50, 'trainer': 50}, ['rollout', 'trainer'], step=10, trial_iterations=3)
  timeline = [slack.Span('collect/0', 'rollout/0', 0, 0.5), slack.Span('train', 'trainer', 0, 2.0)]
  out = [tuner.step(i, 2.0, timeline) for i in range(3)]
  assert out[2].action == 'try' and out[2].quotas == {'rollout': 40, 'trainer': 60}
  out = [tuner.step(i, t, timeline) for i, t in zip(range(3, 6), (1.7, 1.8, 5.0))]  # median 1.8: 10 % faster
  assert out[2].action == 'keep' and out[2].measured_s == pytest.approx(1.8) and tuner.quotas['trainer'] == 60
  out = [tuner.step(i, 2.0, timeline) for i in range(6, 9)]  # the new baseline (2.0), then the next candidate
  assert out[2].action == 'try' and out[2].quotas == {'rollout': 30, 'trainer': 70}
  out = [tuner.step(i, 2.01, timeline) for i in range(9, 12)]  # slower: back to the kept quotas
  assert out[2].action == 'revert' and out[2].quotas == {'rollout': 40, 'trainer': 60}
  assert tuner.quotas == {'rollout': 40, 'trainer': 60} and 'reverted' in out[2].reason
  out = [tuner.step(i, 2.0, timeline) for i in range(12, 15)]  # the reverted candidate is not proposed again
  assert out[2].action == 'hold' and 'every candidate was tried' in out[2].reason
  assert [d.action for d in tuner.decisions] == ['try', 'keep', 'try', 'revert', 'hold']


def test_a_timeline_naming_a_task_twice_is_refused():
  with pytest.raises(ValueError, match='names each task once'):
    slack.analyse([slack.Span('a', 'p', 0, 1), slack.Span('a', 'q', 0, 1)])


def test_a_critical_role_that_runs_alone_grows_when_nothing_has_slack():
  """sync: collect, then train; the rollout quota is the only live knob and nothing runs beside the collect."""
  timeline = [slack.Span('collect/0', 'rollout/0', 0, 1.0), slack.Span('train', 'trainer', 1.0, 2.0)]
  a = slack.analyse(timeline, {'train': ['collect/0']})
  assert a.alone == {'rollout', 'trainer'}
  candidate, why = slack.propose({'rollout': 40, 'trainer': 60}, a, frozenset({'rollout'}), step=10)
  assert candidate == {'rollout': 50, 'trainer': 60} and 'nothing beside it' in why
  rejected = frozenset({(('rollout', 50), ('trainer', 60))})
  assert slack.propose({'rollout': 40, 'trainer': 60}, a, frozenset({'rollout'}), 10, rejected=rejected)[0] is None


class _Feedback:

  def __init__(self):
    self.snap = None

  def snapshot(self):
    return self.snap


def _snap(iterations, stage_s, last_t):
  from ebrl_jax.runtime import feedback  # pylint: disable=g-import-not-at-top
  return feedback.FeedbackSnapshot(iterations, stage_s, 0.0, last_t, 0.0, 0.0, 0.0, iterations - 1, 0.0)


def _run_trigger(sm_quotas: str, start_quota: int, collect_s=(1.0, 1.5)):
  """controller/slack_quotas.py with stand-ins for the workers' feedback and the quota changer: 3 looks of 2
  iterations each (group collects `collect_s`, train 0.5 s, 2.0 s per iteration); (cfg, trigger, changes)."""
  import types  # pylint: disable=g-import-not-at-top
  from ebrl_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from ebrl_jax.controller import slack_quotas  # pylint: disable=g-import-not-at-top
  cfg = config_lib.Config(schedule=config_lib.ScheduleConfig(name='overlap', num_groups=2),
                          sim=config_lib.SimConfig(num_envs=32),
                          algo=config_lib.AlgoConfig(batch_size=32, num_minibatches=8),
                          resources=config_lib.ResourceConfig(use_mps=True,
                                                              sm_quotas=sm_quotas,
                                                              slack_quotas=True,
                                                              slack_trial_iterations=2,
                                                              replan_period_s=1e-9))
  rollouts, trainer = {'rollout/0': _Feedback(), 'rollout/1': _Feedback()}, _Feedback()
  workers = types.SimpleNamespace(controls={
      r: types.SimpleNamespace(feedback=f) for r, f in rollouts.items()
  },
                                  trainer_feedback=trainer)
  trigger = slack_quotas.SlackTrigger(cfg, workers)
  changes = []
  changer = types.SimpleNamespace(quota=start_quota, change=lambda q, why: changes.append((q, why)))
  for look in range(3):
    n = 2 * look
    rollouts['rollout/0'].snap = _snap(n, collect_s[0] * n, 0.0)
    rollouts['rollout/1'].snap = _snap(n, collect_s[1] * n, 0.0)
    trainer.snap = _snap(n, 0.5 * n, 2.0 * n)
    trigger.poll(changer)
  return cfg, trigger, changes


def test_slack_trigger_rebuilds_a_timeline_and_swaps_only_on_try_and_revert():
  _, trigger, changes = _run_trigger('rollout=40,trainer=60', 40)
  # The first look sets baselines; two measured looks make the baseline; the collect runs alone: grow it.
  assert [d['action'] for d in trigger.decisions] == ['try'] and changes[0][0] == 50
  assert 'nothing beside it' in changes[0][1]
  spans = trigger.tuner.decisions[0]
  assert spans.baseline_s == pytest.approx(2.0)


def test_slack_trigger_without_a_rollout_quota_starts_from_100():
  """--slack_quotas with --sm_quotas giving no rollout quota: the tuner starts at MPS's no-limit 100 % (before,
  such a run kept its quotas with only a warning) and decides from there with its reason: here a group is on the
  critical path (so the rollout role has no slack) and it runs alone at 100 % already, so it holds."""
  from ebrl_jax.controller import slack_quotas  # pylint: disable=g-import-not-at-top
  cfg, trigger, changes = _run_trigger('', 100, collect_s=(0.5, 1.5))
  assert slack_quotas.start_quotas(cfg) == {'rollout': 100}
  assert [d['action'] for d in trigger.decisions] == ['hold'] and changes == []
  assert trigger.decisions[0]['quotas'] == {'rollout': 100}
  assert 'no critical role below 100 % runs alone' in trigger.decisions[0]['reason']
