"""Telemetry on a machine without a GPU: CPU use per process from /proc, GPU fields absent with a reason."""
import json
import os
import subprocess
import sys
import time

from ebrl_jax.resources import telemetry


def test_cpu_seconds_grow_with_work_and_vanish_with_the_process():
  before = telemetry.cpu_seconds(os.getpid())
  deadline = time.process_time() + 0.3
  while time.process_time() < deadline:
    pass
  assert telemetry.cpu_seconds(os.getpid()) >= before + 0.25
  child = subprocess.Popen([sys.executable, '-c', 'pass'])
  child.wait()
  assert telemetry.cpu_seconds(child.pid) is None


def test_samples_a_busy_and_an_idle_process(tmp_path):
  busy = subprocess.Popen([sys.executable, '-c', 'import time\nt = time.time()\nwhile time.time() - t < 3: pass'])
  idle = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3)'])

  def cpu_s(pid):  # the process's user + system CPU seconds, from the kernel
    fields = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')

  try:
    tel = telemetry.Telemetry(str(tmp_path),
                              lambda: {
                                  'busy': busy.pid,
                                  'idle': idle.pid
                              },
                              period=0.1,
                              trace_dir=str(tmp_path / 'trace')).start()
    c0, t0 = cpu_s(busy.pid), time.monotonic()
    time.sleep(1.5)
    truth = 100 * (cpu_s(busy.pid) - c0) / (time.monotonic() - t0)
    means = tel.stop()
  finally:
    busy.kill()
    idle.kill()
  # One core's worth is 100 %. How much the spinner gets depends on the machine's load (2 cores shared with
  # other tests): the sampled mean must agree with the kernel's count over the same window.
  assert truth > 10, truth
  assert abs(means['cpu_pct/busy'] - truth) < 20, (means, truth)
  assert means['cpu_pct/idle'] < 10, means
  assert means['samples'] >= 8
  assert 'sm_activity_pct' not in means and means['gpu_reason']  # no NVML device here
  lines = [json.loads(line) for line in open(tmp_path / 'telemetry.jsonl')]
  assert len(lines) == means['samples'] and all('t' in r for r in lines)
  counters = json.load(open(tmp_path / 'trace' / 'telemetry.trace.json'))['traceEvents']
  assert {e['name'] for e in counters if e['ph'] == 'C'} == {'cpu_pct/busy', 'cpu_pct/idle'}


def test_the_sampled_gpu_is_the_one_the_process_computes_on():
  assert telemetry.visible_gpu({}) == '0'
  assert telemetry.visible_gpu({'CUDA_VISIBLE_DEVICES': '1,0'}) == '1'
  assert telemetry.visible_gpu({'CUDA_VISIBLE_DEVICES': 'GPU-8f2a,GPU-11'}) == 'GPU-8f2a'
  assert telemetry.visible_gpu({'CUDA_VISIBLE_DEVICES': ''}) == '0'
