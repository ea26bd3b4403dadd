"""Co-located or separate generation for an MJX workload (`--plan_generation`), worked out by hand on synthetic
profiles: the planner's iteration model for both layouts, the per-step hand-off of each transport, the margin."""
import dataclasses

import pytest

from ebrl_jax import config as config_lib
from ebrl_jax.resources import autoplan
from ebrl_jax.resources import generation_choice
from ebrl_jax.resources import planner
from test_planner import _profile  # pylint: disable=g-bad-import-order

# sim: 1.0 s per step at any quota >= 10 % (a light simulation); generation: 0.1 s x 100 / q (a heavy policy that
# uses every SM it gets); train: 1.0 s. 4096 envs in 4 groups of 1024; quotas 10, 20 or 60 %.
PROFILES = {
    'sim': _profile('sim', 1.0, 0.0, 10.0, (1024, 4096), (10, 20, 60)),
    'generation': _profile('generation', 0.1, 0.0, 100.0, (1024, 4096), (10, 20, 60)),
    'train': _profile('train', 1.0, 0.0, 10.0, (4096,), (10, 20, 60)),
}
SPACE = planner.PlanSpace(num_envs=4096, num_groups=(4,), quotas=(10, 20, 60), shared_option=False)


def test_separate_generation_wins_where_the_policy_needs_the_sms_the_groups_cannot_each_have():
  # co-located (sync): 4 q_r <= 100 -> q_r = 20: step = sim 1.0 + gen 0.5 = 1.5 s; T = 1.5 + 1.0 -> 1638.4 /s.
  # separate: 4 q_r + q_g <= 100 -> q_r = 10, q_g = 60: step = max(1.0 + 0.1667 + h, 4 x 0.1667) = 1.1667 + h;
  # with h = 371 us (the host path, below): T = 2.1671 s -> 1890.1 /s, +15.4 % over co-located.
  h = generation_choice.step_handoff_s('host', 1024, 27, 8)
  choice = generation_choice.choose(PROFILES, SPACE, 'sync', h)
  assert not choice.colocate and choice.plan.quotas == {'rollout': 10, 'generation': 60, 'trainer': 10}
  assert choice.predicted['colocated'] == pytest.approx(4096 / 2.5)
  assert choice.predicted['separate'] == pytest.approx(4096 / (2.0 + 1 / 6 + h))
  assert choice.reason.startswith('separate: predicted +15.4% over co-located')


def test_colocated_stays_when_the_hand_off_eats_the_gain_or_within_the_margin():
  # h = 0.5 s a step: separate 1.6667 + 1.0 = 2.6667 s (1536 /s) is slower than co-located's 2.5 s.
  choice = generation_choice.choose(PROFILES, SPACE, 'sync', 0.5)
  assert choice.colocate and choice.predicted['separate'] == pytest.approx(4096 / (2.0 + 1 / 6 + 0.5))
  assert choice.reason.startswith('co-located: separate generation is predicted -6.3% (slower)')
  # h = 0.23 s: separate 2.3967 s is 4.3 % faster, inside the 5 % margin; with no margin it is taken.
  inside = generation_choice.choose(PROFILES, SPACE, 'sync', 0.23)
  assert inside.colocate and '+4.3% (within the 5% margin)' in inside.reason
  assert not generation_choice.choose(PROFILES, SPACE, 'sync', 0.23, margin=0.0).colocate


def test_without_a_generation_profile_generation_stays_colocated():
  profiles = {name: p for name, p in PROFILES.items() if name != 'generation'}
  choice = generation_choice.choose(profiles, SPACE, 'sync', 0.0)
  assert choice.colocate and 'no generation profile' in choice.reason and 'separate' not in choice.predicted


def test_step_hand_off_of_each_transport():
  # host: the mailbox round trip + 4 copies of one group's observations [1024, 27], actions and raw actions
  # [1024, 1, 8] and log-probs [1024] (180,224 bytes) at 2.3 GB/s; cuda_ipc: the round trip + 2 syncs.
  assert generation_choice.step_handoff_s('host', 1024, 27, 8) == pytest.approx(57.7e-6 + 4 * 180_224 / 2.3e9)
  assert generation_choice.step_handoff_s('cuda_ipc', 1024, 27, 8, sync_s=5e-6) == pytest.approx(67.7e-6)
  with pytest.raises(ValueError, match='transport=.nvlink.'):
    generation_choice.step_handoff_s('nvlink', 1, 1, 1)
  with pytest.raises(ValueError, match='handoff_s=-1'):
    generation_choice.choose(PROFILES, dataclasses.replace(SPACE), 'sync', -1.0)


def _cfg(**schedule):
  return config_lib.Config(sim=config_lib.SimConfig(task='ant', backend='mjx', num_envs=4096),
                           algo=config_lib.AlgoConfig(batch_size=2048, num_minibatches=32),
                           schedule=config_lib.ScheduleConfig(name='async', num_groups=4, **schedule),
                           resources=config_lib.ResourceConfig(plan=True, plan_generation=True, platform='cpu'))


def test_plan_generation_applies_the_choice_and_records_why():
  # 4096 envs, 80 policy steps per env per iteration, 1-8 groups, quotas 10-100 % (MPS). Co-located, one group of
  # 4096 at 90 %: 80 x (1.0 + 0.1 x 100 / 90) = 88.889 s -> 3686.4 env-steps/s. Separate cannot beat it: its best
  # (1 group, rollout 10 %, generation 80 %) is 80 x (1.0 + 0.125 + h) = 90.03 s. Co-located stays, and says why.
  cfg, record = autoplan.choose_generation(_cfg(colocate_generation=False), PROFILES, True, 'async')
  assert cfg.schedule.colocate_generation and record['colocated'] and record['transport'] == ''
  assert record['predicted']['colocated'] == pytest.approx(4096 * 80 / (80 * (1.0 + 1 / 9)))
  assert record['reason'].startswith('co-located: separate generation is predicted -1.3% (slower)')
  # The hand-off is the host path's at the run's group size (4 groups of 1024; --platform=cpu: no CUDA IPC).
  assert record['step_handoff_s'] == pytest.approx(generation_choice.step_handoff_s('host', 1024, 27, 8))
  # One act serves --action_chunk x --action_repeat env steps, the model's step: its hand-off is shared by them.
  chunked = _cfg(colocate_generation=False)
  chunked = dataclasses.replace(chunked,
                                policy=dataclasses.replace(chunked.policy, kind='transformer', action_chunk=4),
                                sim=dataclasses.replace(chunked.sim, action_repeat=2),
                                algo=dataclasses.replace(chunked.algo, unroll_length=8))
  _, record = autoplan.choose_generation(chunked, PROFILES, True, 'async')
  per_act = generation_choice.step_handoff_s('host', 1024, 27, 8, 4)
  assert record['act_handoff_s'] == pytest.approx(per_act) and record['step_handoff_s'] == pytest.approx(per_act / 8)
  # Not asked for: no choice made.
  assert autoplan.choose_generation(dataclasses.replace(_cfg(), resources=config_lib.ResourceConfig(plan=True)),
                                    PROFILES, True, 'async')[1] is None


def test_a_separate_choice_another_flag_forbids_stays_colocated_with_the_reason(monkeypatch):
  separate = generation_choice.choose(PROFILES, SPACE, 'sync', 0.0)
  assert not separate.colocate
  monkeypatch.setattr(generation_choice, 'choose', lambda *args, **kwargs: separate)
  cfg, record = autoplan.choose_generation(_cfg(deterministic=True), PROFILES, True, 'async')
  assert cfg.schedule.colocate_generation and record['colocated'] and record['transport'] == ''
  assert record['reason'].startswith('co-located: --deterministic needs --colocate_generation')
  assert '(the model preferred: separate: predicted' in record['reason']
