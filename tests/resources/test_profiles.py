"""StageProfile fit, fallback and run-time correction; ProfileStore files. Model: t = k (a + c b) max(1, q_sat / q)."""
import json
import os

import numpy as np
import pytest

from ebrl_jax.resources.profiles import ProfileStore, StageProfile, machine_id, workload_id

MACHINE = machine_id('NVIDIA H200', 16)
WORKLOAD = workload_id('ant', 'mjx', 4096, 'mlp:32x4')


def _synthetic(a, c, q_sat, batches=(256, 1024, 4096), quotas=(10, 20, 30, 50, 70, 100), noise=0.0, seed=0):
  rng = np.random.default_rng(seed)
  profile = StageProfile('sim')
  for b in batches:
    for q in quotas:
      profile.add_sample(b, q, (a + c * b) * max(1.0, q_sat / q) * (1 + noise * rng.standard_normal()))
  return profile


def test_fit_recovers_known_parameters_from_noiseless_samples():
  # a = 2 ms a call, c = 1 us an env, q_sat = 40 %: e.g. t(1024, 20) = (0.002 + 0.001024) * 40/20 = 6.048 ms.
  profile = _synthetic(0.002, 1e-6, 40.0)
  assert profile.is_fitted
  p = profile.params
  assert p['overhead_s'] == pytest.approx(0.002, rel=1e-6)
  assert p['per_item_s'] == pytest.approx(1e-6, rel=1e-6)
  assert p['saturation_quota'] == pytest.approx(40.0, abs=0.25)  # the q_sat grid's resolution
  assert profile.predict(1024, 20) == pytest.approx(0.006048, rel=1e-6)
  assert 'fitted' in profile.fit_note


def test_fit_with_noise_stays_close():
  profile = _synthetic(0.002, 1e-6, 60.0, noise=0.02, seed=1)
  p = profile.params
  assert p['overhead_s'] == pytest.approx(0.002, rel=0.15)
  assert p['per_item_s'] == pytest.approx(1e-6, rel=0.1)
  assert p['saturation_quota'] == pytest.approx(60.0, abs=5.0)


def test_predict_is_monotone_even_when_samples_suggest_otherwise():
  # Noisy samples whose times FALL with batch (an unconstrained fit would give c < 0) must still predict
  # a time that never falls with batch nor rises with quota: the fit keeps a, c >= 0.
  profile = StageProfile('generation')
  for b, t in ((128, 0.0030), (1024, 0.0028), (4096, 0.0025)):
    for q in (20, 50, 100):
      profile.add_sample(b, q, t * max(1.0, 50 / q))
  assert profile.params['per_item_s'] >= 0 and profile.params['overhead_s'] >= 0
  batches, quotas = [1, 64, 128, 1000, 4096, 20000], [1, 5, 10, 25, 33, 50, 75, 100]
  grid = np.array([[profile.predict(b, q) for q in quotas] for b in batches])
  assert np.all(np.diff(grid, axis=0) >= 0), grid  # rows: growing batch
  assert np.all(np.diff(grid, axis=1) <= 0), grid  # columns: growing quota


def test_too_few_samples_fall_back_conservatively_and_say_so():
  profile = StageProfile('train')
  profile.add_sample(1000, 50, 0.1)
  assert not profile.is_fitted
  assert 'one quota' in profile.fit_note and 'one batch' in profile.fit_note
  # Assumed a = 0 and q_sat = 50: time proportional to batch; no speed-up above 50 %, 1/q below it.
  assert profile.predict(2000, 50) == pytest.approx(0.2)  # 0.1 * 2000/1000
  assert profile.predict(1000, 100) == pytest.approx(0.1)  # saturated at the measured 50 %
  assert profile.predict(1000, 25) == pytest.approx(0.2)  # 0.1 * 50/25


def test_no_samples_is_an_error_naming_the_stage():
  with pytest.raises(ValueError, match="'sim'.*no samples"):
    StageProfile('sim').predict(64, 50)
  with pytest.raises(ValueError, match='quota'):
    StageProfile('sim').add_sample(64, 0, 0.1)


def test_observe_moves_every_prediction_toward_measurements():
  profile = _synthetic(0.002, 1e-6, 40.0)
  profile.ema_alpha = 0.5
  before = profile.predict(1024, 20)  # 6.048 ms
  other = profile.predict(4096, 100)  # (0.002 + 0.004096) * 1 = 6.096 ms
  # Measured twice the model each time; k = 1 -> 0.5 * 1 + 0.5 * 2 = 1.5 -> 0.5 * 1.5 + 0.5 * 2 = 1.75.
  assert profile.observe(1024, 20, 2 * before) == pytest.approx(1.5)
  assert profile.observe(1024, 20, 2 * before) == pytest.approx(1.75)
  assert profile.predict(1024, 20) == pytest.approx(1.75 * before)
  assert profile.predict(4096, 100) == pytest.approx(1.75 * other)  # one global factor, not per point
  profile.add_sample(512, 50, 0.0025)  # a refit keeps the correction
  assert profile.params['correction'] == pytest.approx(1.75)


def test_store_round_trip(tmp_path):
  path = str(tmp_path / 'profiles' / 'h200.json')
  store = ProfileStore(MACHINE, WORKLOAD)
  for name, profile in (('sim', _synthetic(0.002, 1e-6, 40.0)), ('train', _synthetic(0.05, 1e-5, 100.0))):
    store.profiles[name] = profile
  store['sim'].observe(1024, 20, 0.01)
  assert store.save(path) == path
  assert os.listdir(tmp_path / 'profiles') == ['h200.json']  # no temporary file left behind
  loaded = ProfileStore.load(path, MACHINE, WORKLOAD)
  assert sorted(loaded) == ['sim', 'train']
  for name in ('sim', 'train'):
    assert loaded[name].samples == store[name].samples
    assert loaded[name].correction == store[name].correction
    assert loaded[name].predict(3000, 35) == pytest.approx(store[name].predict(3000, 35), rel=1e-12)
  loaded.profile('generation').add_sample(64, 100, 0.001)
  loaded.save()  # to the file it was loaded from
  assert 'generation' in ProfileStore.load(path, MACHINE, WORKLOAD)


def test_other_machine_workload_or_missing_file_gives_an_empty_store(tmp_path):
  path = str(tmp_path / 'p.json')
  assert len(ProfileStore.load(path, MACHINE, WORKLOAD)) == 0  # missing
  store = ProfileStore(MACHINE, WORKLOAD)
  store.profile('sim').add_sample(64, 100, 0.001)
  store.save(path)
  assert len(ProfileStore.load(path, MACHINE, WORKLOAD)) == 1
  assert len(ProfileStore.load(path, machine_id('NVIDIA H100', 16), WORKLOAD)) == 0
  assert len(ProfileStore.load(path, MACHINE, workload_id('ant', 'mjx', 8192, 'mlp:32x4'))) == 0


def test_a_store_keeps_its_driver_and_one_from_another_driver_is_used_with_a_warning(tmp_path, caplog):
  path = str(tmp_path / 'p.json')
  store = ProfileStore.load(path, MACHINE, WORKLOAD, driver='570.86')
  store.profile('sim').add_sample(64, 100, 0.001)
  store.save()
  with open(path) as f:
    assert json.load(f)['driver'] == '570.86'
  caplog.set_level('WARNING')
  assert len(ProfileStore.load(path, MACHINE, WORKLOAD, driver='570.86')) == 1
  assert 'driver' not in caplog.text
  other = ProfileStore.load(path, MACHINE, WORKLOAD, driver='580.159.04')
  assert len(other) == 1 and other.driver == '580.159.04'  # what it measures next is under this driver
  assert 'measured under GPU driver 570.86; this machine runs 580.159.04' in caplog.text


@pytest.mark.parametrize('text', [
    '{"format": ', '[1, 2]',
    '{"format": "ebrl_jax.resources.profiles/1", '
    '"machine": "%s", "workload": "%s", "profiles": {"sim": {"samples": [[1, 2]]}}}' % (MACHINE, WORKLOAD)
])
def test_malformed_file_is_a_value_error_naming_it(tmp_path, text):
  path = tmp_path / 'broken.json'
  path.write_text(text)
  with pytest.raises(ValueError, match='broken.json'):
    ProfileStore.load(str(path), MACHINE, WORKLOAD)


def test_saved_file_is_plain_json(tmp_path):
  store = ProfileStore(MACHINE, WORKLOAD)
  store.profile('sim').add_sample(64, 100, 0.001)
  data = json.loads(open(store.save(str(tmp_path / 'p.json'))).read())
  assert data['machine'] == MACHINE and data['profiles']['sim']['samples'] == [[64, 100.0, 0.001]]
