"""experiments/curves.py: evaluation curves from metrics.jsonl of runs that ended without a summary."""
import gzip
import json

import pytest

from experiments import curves


def _write(path, records, tail=''):
  opener = gzip.open if str(path).endswith('.gz') else open
  with opener(path, 'wt') as f:
    f.write(''.join(json.dumps(r) + '\n' for r in records) + tail)


RECORDS = [
    {
        'env_steps': 0,
        'wall_s': 10.0,
        'eval/episode_return': -90.0
    },
    {
        'env_steps': 0,
        'wall_s': 10.0,
        'time/compile_s': 30.0
    },
    {
        'env_steps': 100,
        'wall_s': 12.0,
        'rollout/env_steps_per_s': 50.0
    },
    {
        'env_steps': 100,
        'wall_s': 12.5,
        'eval/episode_return': -10.0
    },
    {
        'env_steps': 200,
        'wall_s': 14.0,
        'rollout/env_steps_per_s': 70.0
    },
    {
        'env_steps': 200,
        'wall_s': 14.5,
        'eval/episode_return': 5.0
    },
]


def test_a_killed_runs_metrics_give_its_curve_and_first_hit(tmp_path):
  path = tmp_path / 'metrics.jsonl.gz'
  _write(path, RECORDS, tail='{"env_steps": 300, "wall_s"')  # the write a kill cut
  c = curves.curve_of(curves.read_metrics(str(path)), target=0.0, train_metrics=('rollout/env_steps_per_s',))
  assert c['train_metrics']['rollout/env_steps_per_s'] == [{
      'env_steps': 100,
      'value': 50.0
  }, {
      'env_steps': 200,
      'value': 70.0
  }]
  assert [p['return'] for p in c['eval_curve']] == [-90.0, -10.0, 5.0]
  assert c['best_eval_return'] == 5.0 and c['env_steps'] == 200 and c['compile_s'] == 30.0
  assert (c['env_steps_to_target'], c['wall_s_to_target']) == (200, 14.5)
  assert c['rollout_env_steps_per_s_median'] == 70.0
  assert curves.curve_of(RECORDS, target=10.0)['env_steps_to_target'] is None
  with pytest.raises(ValueError, match='no evaluation'):
    curves.curve_of(RECORDS[1:3], target=None)


def test_a_resumed_runs_records_are_split_by_process_and_its_target_named_by_its_process(tmp_path):
  resumed = [  # --resume appends to the same metrics.jsonl, the new process's clock starting again
      {
          'env_steps': 200,
          'wall_s': 3.0,
          'time/compile_s': 3.0
      },
      {
          'env_steps': 300,
          'wall_s': 4.0,
          'eval/episode_return': 20.0
      },
  ]
  c = curves.curve_of(RECORDS + resumed, target=10.0)
  assert [p['process'] for p in c['eval_curve']] == [0, 0, 0, 1]
  assert (c['processes'], c['env_steps_to_target'], c['wall_s_to_target'], c['process_of_target']) == (2, 300, 4.0, 1)
  one = curves.curve_of(RECORDS, target=0.0)
  assert (one['processes'], one['process_of_target']) == (1, 0)
  path = tmp_path / 'r.jsonl'
  _write(path, RECORDS + resumed)
  assert curves.main([f'--run=r={path}', f'--out={tmp_path}/r.json']) == 0  # the plot draws each process's line


def test_the_command_writes_json_and_png_and_names_a_bad_run(tmp_path, capsys):
  _write(tmp_path / 'a.jsonl', RECORDS)
  out = tmp_path / 'screen.json'
  assert curves.main([f'--run=a={tmp_path}/a.jsonl', '--target=0', f'--out={out}']) == 0
  assert json.load(open(out))['runs']['a']['best_eval_return'] == 5.0 and (tmp_path / 'screen.png').exists()
  with pytest.raises(SystemExit):
    curves.main([f'--run=b={tmp_path}/missing.jsonl', f'--out={out}'])
  assert 'missing.jsonl does not exist' in capsys.readouterr().err
