"""experiments/bench/curve_agreement.py on hand-written harness results: pairs of labels compared by version."""
import json

import pytest

from experiments.bench import curve_agreement


def _run(curve):
  return {'summary': {'eval_curve': [{'version': v, 'env_steps': 10 * v, 'return': r} for v, r in curve]}}


RESULT = {
    'seeds': [0, 1],
    'runs': {
        'sync': [_run([(0, -81.5), (62, -70.25), (124, -58.5)]),
                 _run([(0, 1.0), (5, 2.0)])],
        'overlap': [_run([(0, -81.5), (62, -70.25), (124, -59.0), (186, -20.0)]),
                    _run([(0, 1.0), (5, 2.0)])],
        'sync_b': [_run([(0, -81.5), (62, -74.0)])],
    }
}


def test_pairs_are_compared_on_common_versions_per_seed():
  rows = {(tuple(r['labels']), r['seed']): r for r in curve_agreement.agreement(RESULT)}
  first = rows[(('sync', 'overlap'), 0)]
  assert first['versions'] == [0, 62, 124]  # overlap's version 186 has no partner
  assert not first['identical'] and first['first_difference_version'] == 124
  assert first['max_abs_difference'] == pytest.approx(0.5)
  assert rows[(('sync', 'overlap'), 1)]['identical']
  assert rows[(('sync', 'overlap'), 1)]['first_difference_version'] is None
  parted = rows[(('sync', 'sync_b'), 0)]
  assert parted['first_difference_version'] == 62 and parted['max_abs_difference'] == pytest.approx(3.75)
  assert (('overlap', 'sync_b'), 1) not in rows  # sync_b ran seed 0 only


def test_cli_writes_rows_and_refuses_an_unknown_label(tmp_path, capsys):
  path = tmp_path / 'result.json'
  path.write_text(json.dumps(RESULT))
  out = tmp_path / 'agreement.json'
  assert curve_agreement.main([str(path), '--labels=sync,overlap', f'--out={out}']) == 0
  assert 'sync vs overlap (seed 0): 3 versions, differ from version 124' in capsys.readouterr().out
  assert len(json.loads(out.read_text())['rows']) == 2
  assert curve_agreement.main([str(path), '--labels=sync,async']) == 2
  assert "labels ['async'] are not in the result" in capsys.readouterr().err
