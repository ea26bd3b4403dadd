"""A run whose loss becomes NaN/inf (here forced: rewards scaled by 1e30 make the value loss overflow float32 in
the first update) stops with its summary written, `stopped` = 'non_finite' naming the metric, no checkpoint of the
garbage state, one `FATAL:` line that says what to do and exit code 3, with no traceback; a process schedule leaves
no worker and no shared memory behind. Before, `fused` ended with a Python traceback and no summary."""
import json
import os
import subprocess
import sys

import runs_testlib  # pylint: disable=g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _diverge(run_dir, *flags):
  done = subprocess.run([
      sys.executable, '-m', 'ebrl_jax.main', '--flagfile=experiments/quickstart.flags', '--reward_scaling=1e30',
      '--compilation_cache_dir=', '--noprogress_bar', '--telemetry_period_s=0', f'--run_dir={run_dir}', *flags
  ],
                        cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'),
                        capture_output=True,
                        text=True,
                        timeout=300)
  out = done.stdout + done.stderr
  assert done.returncode == 3, out[-3000:]
  assert 'Traceback' not in out, out[-3000:]
  fatal = [line for line in done.stderr.splitlines() if line.startswith('FATAL:')]
  assert len(fatal) == 1, out[-3000:]
  assert fatal[0].startswith('FATAL: training diverged: metric train/ppo/') and ' is inf at env step ' in fatal[0]
  assert f'{run_dir}/summary.json holds the run so far' in fatal[0] and '--learning_rate' in fatal[0]
  summary = json.load(open(run_dir / 'summary.json'))
  assert summary['stopped'] == 'non_finite' and summary['env_steps'] > 0
  assert summary['extra']['diverged'].startswith('metric train/ppo/') and summary['eval_curve']
  assert summary['extra']['last_checkpoint'] is None  # the first update diverged: nothing before it was saved
  assert 'nothing to resume' in fatal[0]
  return summary


def test_a_diverged_fused_run_writes_its_summary_and_stops_with_one_fatal_line(tmp_path):
  assert _diverge(tmp_path / 'fused')['schedule'] == 'fused'


def test_a_diverged_process_schedule_stops_the_same_way_and_leaves_nothing(tmp_path):
  run_dir = tmp_path / 'async'  # the trainer worker's summary reaches the controller, which raises Diverged
  assert _diverge(run_dir, '--schedule=async', '--num_groups=2')['schedule'] == 'async'
  runs_testlib.assert_nothing_left(run_dir)
