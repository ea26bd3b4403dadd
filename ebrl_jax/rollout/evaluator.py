"""Evaluator process (`--evaluator=process`, sync / async): evaluates the policy versions the trainer asks for while
training goes on, and reports each one's return to the trainer.

It waits for a newer version in the evaluation parameter store (written by the trainer, see
`trainer/remote_eval.py`), copies it, runs the evaluation rollouts every schedule uses (`rollout/evaluation.py`:
`sim.num_eval_envs` fresh episodes) with the key the in-trainer evaluation of that version draws
(`rollout.keys.eval_key(root, version)`), so a version's score is the one the trainer would have recorded for it,
bit for bit, and puts a `types.EvalReport` on the report channel. Its first evaluation compiles, in this process,
while the trainer starts.
NOTE: a restarted evaluator (after a death) starts from the store's newest version, which is the one in flight
when its predecessor died (the trainer publishes the next only once that is reported), or one already reported
(the trainer drops the repeat).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple, Optional

from absl import logging
import jax
import numpy as np

from ebrl_jax import config as config_lib
from ebrl_jax import sim
from ebrl_jax import types
from ebrl_jax.generation import policies
from ebrl_jax.rollout import evaluation
from ebrl_jax.rollout import keys
from ebrl_jax.runtime import lifecycle
from ebrl_jax.runtime import startup
from ebrl_jax.runtime import trace_cache
from ebrl_jax.runtime import tracing
from ebrl_jax.transport import ChannelClosed

_WAIT_S = 0.005  # how often an idle evaluator looks for a newer version (it is off the critical path)


@dataclasses.dataclass(frozen=True)
class EvaluatorConfig:
  """The evaluator's part of the run: the evaluation envs (`SimConfig`), the policy, the run's seed (the keys'
  root) and whether it evaluates the policy's mode (--deterministic_eval)."""
  process: startup.ProcessConfig
  sim: config_lib.SimConfig
  policy: config_lib.PolicyConfig
  seed: int
  deterministic: bool


class EvaluatorChannels(NamedTuple):
  """What the controller hands the evaluator: the evaluation parameter store, the report channel, the stop."""
  store: Any
  reports: Any
  stop: Any


def evaluate_version(evaluator, root_key, version: int, params) -> types.EvalReport:
  """One version's evaluation as a report: `evaluator.evaluate(params, eval_key(root_key, version))`."""
  t0 = time.monotonic()
  metrics = evaluator.evaluate(params, keys.eval_key(root_key, version))
  return types.EvalReport(version=np.int64(version),
                          episode_return=np.float64(metrics['eval/episode_return']),
                          episode_length=np.float64(metrics['eval/episode_length']),
                          seconds=np.float64(time.monotonic() - t0),
                          unix=np.float64(time.time()))


def _wait_for_newer(store, version: int, stop) -> bool:
  while not stop.is_set():
    if store.version() > version:
      return True
    time.sleep(_WAIT_S)
  return False


def _put(reports, report, stop) -> bool:
  while not stop.is_set():
    try:
      reports.put(report, timeout=0.5)
      return True
    except TimeoutError:
      continue
  return False


def evaluator_main(cfg: EvaluatorConfig, channels: EvaluatorChannels, incarnation: int = 0, env: Optional[dict] = None):
  """Process entry point (`incarnation`: how many times the evaluator was restarted): evaluates each newer version
  the store holds until the run stops."""
  startup.start_process(cfg.process, env)
  stop = lifecycle.ParentWatch(channels.stop)
  phase = lifecycle.Phase(cfg.process.run_dir, 'evaluator' + (f'#{incarnation}' if incarnation else ''))
  phase('building its evaluation envs')
  tracer = tracing.Tracer(cfg.process.trace_dir, 'evaluator')
  spec = sim.spec_of(cfg.sim)
  network = policies.make_network(cfg.policy, spec.obs_dim, spec.action_dim, spec.pixel_shape)
  evaluator = evaluation.make_evaluator(cfg.sim, cfg.policy, cfg.seed, cfg.deterministic, network,
                                        trace_cache.lowerer(cfg.process.trace_cache_dir))
  root_key = keys.root(cfg.seed)
  last, compiled = -1, False
  try:
    while True:
      phase('waiting for the first version to evaluate')
      if not _wait_for_newer(channels.store, last, stop):
        break
      version, host_params = channels.store.latest()
      params = jax.device_put(host_params)
      if not compiled:
        phase('the first evaluation (compiling it)')
        evaluator.lower_and_compile(params)
        compiled = True
      with tracer.span('evaluator/evaluate', version=version):
        report = evaluate_version(evaluator, root_key, version, params)
      with tracer.span('evaluator/put_report', version=version):
        if not _put(channels.reports, report, stop):
          break
      startup.pin_after_startup()  # the evaluation compiled: the evaluator takes its one core
      phase.done('evaluating')
      last = version
  except (ChannelClosed, InterruptedError):
    pass
  finally:
    evaluator.close()
    tracer.close()
  logging.info('evaluator: stopped.')
