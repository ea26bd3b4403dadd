"""experiments/bench/gpu_session.sh's output: one file per part (the device returns at most 8 files a call), holding
only what that invocation may claim, checked through its `pack` part on a work folder made here."""
import os
import subprocess
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'experiments', 'bench', 'gpu_session.sh')


def _write(path, text):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    f.write(text)


def test_pack_leaves_one_tarball_of_the_files_newer_than_its_date(tmp_path):
  work, out = tmp_path / 'work', tmp_path / 'out'
  _write(str(work / 'old.json'), '{"old": 1}')
  _write(str(work / 'old_runs/fused/seed0/output.log'), 'old output\n')
  old = time.mktime((2020, 1, 1, 0, 0, 0, 0, 0, -1))
  for p in (work / 'old.json', work / 'old_runs/fused/seed0/output.log'):
    os.utime(p, (old, old))
  _write(str(work / 'w2_learn.json'), '{"runs": {}}')
  _write(str(work / 'w2_learn.log'), 'line\n' * 50 + 'wrote w2_learn.json\n')
  _write(str(work / 'w2_learn_runs/telemetry_gpu0.jsonl'), '{"t": 0}\n')
  _write(str(work / 'w2_learn_runs/fused/seed0/output.log'), 'I1203 run output\n')
  _write(str(work / 'w2_learn_runs/fused/seed0/metrics.jsonl'), '{"env_steps": 0}\n')
  scratch = tmp_path / 'tmp'  # the script's stamp and staging folder (mktemp), gone when it ends
  scratch.mkdir()
  env = dict(os.environ, EBRL_BENCH_ROOT=str(work), PACK_SINCE='2021-01-01', TMPDIR=str(scratch))
  done = subprocess.run(['bash', SCRIPT, 'pack', str(out)],
                        cwd=ROOT,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=60)
  assert done.returncode == 0, done.stderr
  assert sorted(os.listdir(out)) == ['pack.tgz']
  assert 'wrote w2_learn.json' in done.stdout  # the logs' last lines reach the console too
  with tarfile.open(out / 'pack.tgz') as tar:
    names = sorted(os.path.basename(n) for n in tar.getnames() if tar.getmember(n).isfile())
    assert names == [
        'w2_learn.json', 'w2_learn.log.tail', 'w2_learn_runs_fused_seed0_metrics.jsonl.gz',
        'w2_learn_runs_fused_seed0_output.log.gz', 'w2_learn_telemetry_gpu0.jsonl.gz'
    ], names
    tail = tar.extractfile([m for m in tar.getmembers() if m.name.endswith('w2_learn.log.tail')][0]).read()
    assert tail.endswith(b'wrote w2_learn.json\n')
  assert not os.listdir(scratch)


def test_an_unknown_part_is_refused_by_name_and_leaves_no_stamp(tmp_path):
  scratch = tmp_path / 'tmp'
  scratch.mkdir()
  env = dict(os.environ, EBRL_BENCH_ROOT=str(tmp_path / 'work'), TMPDIR=str(scratch))
  done = subprocess.run(['bash', SCRIPT, 'nope', str(tmp_path / 'out')],
                        cwd=ROOT,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=60)
  assert done.returncode == 2 and 'unknown part nope' in done.stdout
  assert not os.listdir(scratch)
