"""experiments/mps_kill.py end to end on CPU: a stand-in MPS daemon that is a real process (a renamed `sleep`,
so it is found by its CUDA_MPS_PIPE_DIRECTORY the way the real one is), killed by the probe mid-run; the probe's
record must show the run's clean stop, nothing left behind, and a resume that finishes."""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -d starts the "server" (a copy of sleep named nvidia-cuda-mps-server, in its own session) and notes its pid in
# the pipe directory; every other command answers only while that process lives, as the real control does.
_CONTROL = """#!/bin/bash
if [ "$1" = "-d" ]; then
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" && touch "$CUDA_MPS_PIPE_DIRECTORY/control"
  setsid "$(dirname "$0")/nvidia-cuda-mps-server" 100000 >/dev/null 2>&1 &
  echo $! > "$CUDA_MPS_PIPE_DIRECTORY/server.pid"
  exit 0
fi
cat > /dev/null
kill -0 "$(cat "$CUDA_MPS_PIPE_DIRECTORY/server.pid" 2>/dev/null)" 2>/dev/null || exit 1
"""


def test_probe_kills_the_runs_daemon_and_the_run_stops_cleanly_then_resumes(tmp_path):
  sleep = shutil.which('sleep')
  if sleep is None or not os.path.isdir('/proc'):
    pytest.skip('needs /proc and a sleep binary')
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  shutil.copy(sleep, bin_dir / 'nvidia-cuda-mps-server')
  (bin_dir / 'nvidia-cuda-mps-control').write_text(_CONTROL)
  (bin_dir / 'nvidia-smi').write_text('#!/bin/sh\nexit 0\n')  # no GPU processes to list
  for name in ('nvidia-cuda-mps-control', 'nvidia-smi'):
    os.chmod(bin_dir / name, 0o755)
  env = dict(os.environ,
             PATH=f'{bin_dir}:{os.environ["PATH"]}',
             JAX_PLATFORMS='cpu',
             PYTHONPATH=ROOT,
             CUDA_MPS_PIPE_DIRECTORY='')
  try:
    _probe_and_check(tmp_path, bin_dir, env)
  finally:  # a stand-in server the probe did not kill (a failed check) must not outlive the test
    for pid in filter(str.isdigit, os.listdir('/proc')):
      try:
        with open(f'/proc/{pid}/cmdline', 'rb') as f:
          if f.read().startswith(str(bin_dir).encode()):
            os.kill(int(pid), signal.SIGKILL)
      except OSError:
        pass


def _probe_and_check(tmp_path, bin_dir, env):
  out = tmp_path / 'out' / 'mps_kill.json'
  proc = subprocess.run([
      sys.executable, 'experiments/mps_kill.py', f'--out={out}', f'--run_dir={tmp_path / "run"}',
      '--start_timeout_s=240', '--stop_timeout_s=60', '--', '--flagfile=experiments/quickstart.flags', '--platform=',
      '--schedule=async', '--num_groups=2', '--num_timesteps=100000000', '--num_evals=2000', '--target_return=100000',
      '--noprogress_bar', '--compilation_cache_dir='
  ],
                        cwd=ROOT,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  record = json.loads(out.read_text())
  assert list(record['mps_processes_killed'].values()) == [f'{bin_dir}/nvidia-cuda-mps-server 100000']
  assert record['exit_code'] == 3 and record['stopped_after_kill_s'] < 30
  assert any('The MPS daemon serving pipe directory' in m and 'died' in m for m in record['messages'])
  assert any(m.startswith('FATAL:') and 'continue with --resume' in m for m in record['messages'])
  assert record['workers_left'] == [] and record['mps_processes_left'] == {} and record['shm_segments_left'] == []
  assert record['resume_exit_code'] == 0
  assert record['resume_summary']['env_steps'] == record['resume_target_env_steps']
  assert record['ok']
  assert (tmp_path / 'out' / 'mps_kill_killed_run.log').exists()
