"""experiments/bench/timeline.py on hand-written trace files: one iteration's tasks, its critical path, slack."""
import json

import pytest

from experiments.bench import timeline


def _write(tmp_path, role, pid, events):
  meta = {'name': 'process_name', 'ph': 'M', 'pid': pid, 'args': {'name': role}}
  body = [dict(e, ph='X', pid=pid) for e in events]
  (tmp_path / (role.replace('/', '_') + '.trace.json')).write_text(json.dumps({'traceEvents': [meta] + body}))


def test_one_iteration_is_mapped_to_graph_tasks_with_its_critical_path(tmp_path):
  # Thread workers share a pid: the file's role names the process.
  _write(tmp_path, 'rollout/0', 1, [{
      'name': 'rollout/collect',
      'ts': 0,
      'dur': 1_000_000,
      'args': {
          'iteration': 3
      }
  }, {
      'name': 'rollout/collect',
      'ts': 9e6,
      'dur': 1e6,
      'args': {
          'iteration': 4
      }
  }])
  _write(tmp_path, 'rollout/1', 1, [{'name': 'rollout/collect', 'ts': 0, 'dur': 3_000_000, 'args': {'iteration': 3}}])
  _write(tmp_path, 'trainer', 1, [
      {
          'name': 'train/h2d',
          'ts': 1_000_000,
          'dur': 100_000,
          'args': {
              'version': 3,
              'group': 0
          }
      },
      {
          'name': 'train/h2d',
          'ts': 3_000_000,
          'dur': 100_000,
          'args': {
              'version': 3,
              'group': 1
          }
      },
      {
          'name': 'train/train_step',
          'ts': 3_100_000,
          'dur': 2_000_000,
          'args': {
              'version': 3
          }
      },
      {
          'name': 'train/publish_params',
          'ts': 5_100_000,
          'dur': 100_000,
          'args': {
              'version': 3
          }
      },
      {
          'name': 'train/evaluate',
          'ts': 3_200_000,
          'dur': 500_000,
          'args': {
              'thread': 'evaluate_0'
          }
      },
  ])
  out = timeline.report(str(tmp_path), 3)
  tasks = {s['task']: s for s in out['spans']}
  assert set(tasks) == {'collect/0', 'collect/1', 'h2d/0', 'h2d/1', 'train', 'publish', 'evaluate'}
  assert tasks['evaluate']['process'] == 'trainer/evaluate' and tasks['train']['end_s'] == pytest.approx(5.1)
  assert out['iteration_s'] == pytest.approx(5.2)
  assert out['critical_path'] == ['collect/1', 'h2d/1', 'train', 'publish']
  assert out['slack_s']['collect/0'] == pytest.approx(1.9) and out['slack_s']['evaluate'] > 1.0
  with pytest.raises(ValueError, match='no span of iteration 7'):
    timeline.report(str(tmp_path), 7)
