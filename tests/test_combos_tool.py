"""experiments/combos.py: every combination it runs is a valid command line, and one that is not is named (the runs
themselves are the tool's work: results/combos_cpu.json)."""
import os
import subprocess
import sys
import time

from experiments import combos

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _combos(*args):
  return subprocess.run([sys.executable, '-m', 'experiments.combos', *args],
                        cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'),
                        capture_output=True,
                        text=True,
                        timeout=120)


def test_every_combination_parses_into_a_config():
  result = _combos('--check')
  assert result.returncode == 0, result.stdout + result.stderr
  lines = result.stdout.strip().splitlines()
  assert len(lines) >= 15 and all(line.endswith(': ok') for line in lines), lines


def test_an_invalid_combination_is_named_with_its_error():
  result = _combos('--check', '--only=reacher_mjx_async_transformer_chunk2', '--extra=--unroll_length=5')
  assert result.returncode == 1
  assert 'reacher_mjx_async_transformer_chunk2: --unroll_length=5 must be a multiple of --action_chunk=2' in result.stdout


def test_an_unknown_name_is_refused_listing_the_known_ones():
  result = _combos('--only=nope')
  assert result.returncode == 2 and 'unknown combinations nope; known: hopper_cpu_sync_3groups' in result.stderr


def test_a_process_left_behind_is_found_by_its_marker_and_a_dead_one_is_not():
  """combos.py finds what a run left by the marker every process of the run inherits (the fault suite's helper);
  a process that has exited but is not yet reaped (a zombie) is not left behind."""
  env = dict(os.environ, **{combos.kill_controller.MARKER: 'combos-test-marker'})
  stray = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], env=env)
  try:
    assert combos.kill_controller.marked_processes('combos-test-marker') == [stray.pid]
    stray.kill()
    deadline = time.monotonic() + 10
    while combos.kill_controller.marked_processes('combos-test-marker') and time.monotonic() < deadline:
      time.sleep(0.05)
    assert combos.kill_controller.marked_processes('combos-test-marker') == []  # a zombie until the wait below
  finally:
    stray.kill()
    stray.wait()
