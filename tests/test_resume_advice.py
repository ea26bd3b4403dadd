"""What a run tells the user to change before --resume holds: a diverged run's advice names only changes --resume
accepts (before: 'set --max_grad_norm, then continue with --resume', which --resume refused), and a checkpoint
whose optimizer state another gradient clipping or learning-rate schedule shaped is refused naming that flag (before:
optax paths only, 'opt_state.1.0.count only in this run', under a header that showed the same --task and --policy on
both sides), a changed --grad_clip_scope included (before: it passed the check, and the trainer then called the
intact checkpoint damaged)."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from ebrl_jax import config as config_lib
from ebrl_jax.config import AlgoConfig, PolicyConfig
from ebrl_jax.controller import resume_check
from ebrl_jax.trainer import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(run_dir, resume=False, **algo):
  return config_lib.Config(sim=config_lib.SimConfig(num_envs=4),
                           policy=PolicyConfig(policy_hidden_sizes=(8,), value_hidden_sizes=(8,)),
                           algo=AlgoConfig(batch_size=4, num_minibatches=1, **algo),
                           schedule=config_lib.ScheduleConfig(run_dir=str(run_dir), resume=resume))


def _save(run_dir, **algo):
  """Checkpoint 1 of a run with `algo`'s optimizer flags (zeros of its train state's shapes)."""
  template = resume_check.state_template(_cfg(run_dir, **algo))
  state = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype), template)
  with checkpoint.Checkpointer(str(run_dir / 'checkpoints')) as ckpt:
    run = {'task': 'inverted_pendulum', 'policy': 'mlp', 'normalize_observations': True}  # zeros: a count of 0
    ckpt.save(1, state, {'env_steps': 100, 'iterations': 1, 'run': run})


@pytest.mark.parametrize('saved,resumed,named', [
    ({}, {
        'max_grad_norm': 0.5
    }, 'a run with --max_grad_norm unset (this run: --max_grad_norm=0.5)'),
    ({
        'max_grad_norm': 0.5
    }, {}, 'a run with --max_grad_norm set (this run: --max_grad_norm unset)'),
    ({
        'max_grad_norm': 0.5
    }, {
        'max_grad_norm': 0.5,
        'grad_clip_scope': 'per_network'
    }, 'a run with --grad_clip_scope=global (this run: --grad_clip_scope=per_network)'),
    ({}, {
        'learning_rate_warmup_updates': 3
    }, 'a run with a constant learning rate (this run: --learning_rate_warmup_updates=3)'),
    ({}, {
        'max_grad_norm': 0.5,
        'learning_rate_warmup_updates': 3
    }, 'a run with --max_grad_norm unset and a constant learning rate (this run: --max_grad_norm=0.5, '
     '--learning_rate_warmup_updates=3)'),
],
                         ids=['clip_added', 'clip_dropped', 'scope_changed', 'schedule_added', 'both_added'])
def test_a_changed_optimizer_layout_is_refused_naming_the_flag(tmp_path, saved, resumed, named):
  _save(tmp_path, **saved)
  with pytest.raises(ValueError) as refused:
    resume_check.check_checkpoints(_cfg(tmp_path, resume=True, **resumed))
  text = str(refused.value)
  assert f'the checkpoint\'s optimizer state is that of {named}' in text, text
  assert 'does not fit this run\'s train state' in text and 'It stays loadable by a run with its own flags' in text
  assert '(this run: --task=' not in text, text  # the same task and policy: no header saying so


@pytest.mark.parametrize('saved,resumed', [({}, {
    'learning_rate': 1e-4
}), ({
    'max_grad_norm': 1.0
}, {
    'max_grad_norm': 0.1,
    'learning_rate': 1e-4
}), ({
    'learning_rate_warmup_updates': 3
}, {
    'learning_rate_warmup_updates': 9
})])
def test_the_values_of_the_optimizer_flags_change_nothing_resume_checks(tmp_path, saved, resumed):
  _save(tmp_path, **saved)
  assert resume_check.check_checkpoints(_cfg(tmp_path, resume=True, **resumed))['step'] == 1


def test_divergence_advice_offers_clipping_only_where_resume_takes_it(tmp_path):
  assert resume_check.divergence_advice(_cfg(tmp_path)) == (
      f'No checkpoint had been written in {tmp_path}/checkpoints yet (see --first_checkpoint_iteration), so there '
      'is nothing to resume: lower --learning_rate or set --max_grad_norm, then start the run again.')
  (tmp_path / 'checkpoints' / '4').mkdir(parents=True)
  assert resume_check.divergence_advice(_cfg(tmp_path, max_grad_norm=1.0)) == (
      f'Its checkpoint 4 in {tmp_path}/checkpoints stays loadable: lower --learning_rate or --max_grad_norm, then '
      'continue with --resume.')
  advice = resume_check.divergence_advice(_cfg(tmp_path))
  assert advice.startswith(f'Its checkpoint 4 in {tmp_path}/checkpoints stays loadable: lower --learning_rate, then '
                           'continue with --resume. Gradient clipping (--max_grad_norm) changes the optimizer')
  assert advice.endswith('a run with it starts afresh, in another --run_dir.')


def _main(run_dir, *flags):
  done = subprocess.run([
      sys.executable, '-m', 'ebrl_jax.main', '--flagfile=experiments/quickstart.flags', '--compilation_cache_dir=',
      '--noprogress_bar', '--telemetry_period_s=0', '--num_evals=0', f'--run_dir={run_dir}', *flags
  ],
                        cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'),
                        capture_output=True,
                        text=True,
                        timeout=300)
  return done.returncode, [line for line in done.stderr.splitlines() if line.startswith('FATAL: ')], done.stderr


def test_a_diverged_run_continues_with_what_its_advice_says(tmp_path):
  """Checkpoint 1 of a quickstart run; resumed with rewards scaled by 1e30 it diverges; its advice; the advice
  followed (a lower --learning_rate, the rewards as before) continues from checkpoint 1 to the end."""
  run_dir = tmp_path / 'run'
  assert _main(run_dir, '--num_timesteps=2000')[0] == 0  # one iteration of 2,560 env steps: checkpoint 1
  code, fatal, out = _main(run_dir, '--resume', '--num_timesteps=8000', '--reward_scaling=1e30')
  assert code == 3 and len(fatal) == 1, out[-3000:]
  assert fatal[0].startswith('FATAL: training diverged: ') and (
      f'Its checkpoint 1 in {run_dir}/checkpoints stays loadable: lower --learning_rate, then continue with '
      '--resume. Gradient clipping (--max_grad_norm)') in fatal[0], fatal[0]
  assert 'set --max_grad_norm, then continue' not in fatal[0]
  # clipping added anyway: refused naming the flag (the check the controller makes before any worker)
  quickstart_with_clipping = config_lib.Config(sim=config_lib.SimConfig(task='inverted_pendulum', num_envs=64),
                                               algo=AlgoConfig(batch_size=64,
                                                               num_minibatches=8,
                                                               unroll_length=5,
                                                               max_grad_norm=0.5),
                                               schedule=config_lib.ScheduleConfig(run_dir=str(run_dir), resume=True))
  with pytest.raises(ValueError, match=r'a run with --max_grad_norm unset \(this run: --max_grad_norm=0.5\)'):
    resume_check.check_checkpoints(quickstart_with_clipping)
  code, fatal, out = _main(run_dir, '--resume', '--num_timesteps=5000', '--learning_rate=1e-4')
  assert code == 0 and not fatal, out[-3000:]
  summary = json.load(open(run_dir / 'summary.json'))
  assert summary['stopped'] == 'num_timesteps' and summary['extra']['resumed_from']['step'] == 1
