"""experiments/stop_check.py: the SIGTERM latency check (run on the GPU), here on a tiny native-MuJoCo run."""
import json
import os

from experiments import stop_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = ('--task=inverted_pendulum', '--num_envs=32', '--batch_size=32', '--num_minibatches=8', '--num_eval_envs=8',
        '--num_threads=1', '--compilation_cache_dir=', '--noprogress_bar', '--num_timesteps=10000000',
        '--num_evals=2000')


def _signalled(tmp_path, monkeypatch, *extra) -> dict:
  """The check's record of a tiny run with `extra` flags, SIGTERM 0.5 s after its first chunk of training."""
  monkeypatch.chdir(ROOT)
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  out = tmp_path / 'stop.json'
  flags = [*TINY, *extra, f'--run_dir={tmp_path}/run']
  assert stop_check.main(['--after_s=0.5', '--timeout_s=240', f'--out={out}', '--', *flags]) == 0
  with open(out) as f:
    return json.load(f)


def test_stop_check_signals_a_training_run_and_reads_its_summary(tmp_path, monkeypatch):
  result = _signalled(tmp_path, monkeypatch)
  assert result['returncode'] == 143 and result['sigterm_s'] >= result['first_training_s'] + 0.5
  assert 0 <= result['exit_after_sigterm_s'] < 60
  assert result['summary']['stopped'] == 'SIGTERM' and result['summary']['iterations'] >= 1
  assert any(line.startswith('STOPPED: SIGTERM') for line in result['stop_lines'])


def test_stop_check_signals_a_process_schedule_whose_metrics_only_its_run_dir_holds(tmp_path, monkeypatch):
  """`async` prints no training metrics to stdout (the trainer worker writes them to metrics.jsonl): the check
  still sends its SIGTERM after the first chunk of training, and the run stops with its summary."""
  result = _signalled(tmp_path, monkeypatch, '--schedule=async', '--num_groups=2')
  assert result['first_training_s'] is not None and result['sigterm_s'] >= result['first_training_s'] + 0.5
  assert result['returncode'] == 143 and result['summary']['stopped'] == 'SIGTERM', result['output_tail']
