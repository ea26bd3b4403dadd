"""What a run reports, finished or stopped (`RunSummary`, made by `make` from the training driver's counts):
`trainer.driver.train` returns it, and the controller writes it to `<run_dir>/summary.json`."""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional


@dataclasses.dataclass
class RunSummary:
  """What a run reports, finished or stopped; the controller writes it to `<run_dir>/summary.json`. Every time
  is on the run's clock (docs/benchmarks.md, Clocks): seconds since its first process started."""
  env_steps: int
  iterations: int
  wall_s: float  # process start -> the end of the run
  compile_s: float  # start-up: process start -> the first iteration counted in the rate (see compile_breakdown)
  train_wall_s: float  # wall time of collection + training, start-up and evaluation excluded
  env_steps_per_s: float  # env_steps / train_wall_s, this session's steps only
  final_eval_return: Optional[float]  # None: stopped before the first evaluation
  best_eval_return: Optional[float]
  target_return: Optional[float]
  env_steps_to_target: Optional[int]
  wall_s_to_target: Optional[float]  # process start -> the evaluation that reached the target
  train_s_to_target: Optional[float]  # collection + training time only
  eval_curve: list
  num_params: int
  schedule: str
  backend: str
  task: str
  device: str
  extra: dict  # schedule-specific figures (segments consumed, dropped, duplicates, worker restarts, ...)
  # Why the run ended: one of trainer.driver's FINISHED, its BUDGETS ('max_wall_s', 'max_train_s'), the signal
  # ('SIGTERM', 'SIGINT'), DIVERGED (a loss or return became NaN/inf), OUT_OF_MEMORY (an allocation XLA refused, here
  # or in a worker), errors.WORKER_FAILED (a worker beside the trainer failed for good) or errors.TRAINER_DIED (the
  # trainer worker died: the controller's summary, from what it had logged); for the failures extra['failure'] says
  # what happened, and the controller raises errors.Diverged, OutOfMemory, WorkerFailure or TrainerDied.
  stopped: str = 'num_timesteps'
  compile_breakdown: Dict[str, float] = dataclasses.field(default_factory=dict)  # the parts of compile_s
  start_unix: Optional[float] = None  # the clock's origin, `time.time()` at process start


def make(cfg, progress, clock, num_params: int, extra: dict, stopped: str, device: str) -> RunSummary:
  """The summary of a run (`cfg`: its `trainer.driver.TrainerConfig`) from the driver's counts (`progress`: a
  `trainer.cadence.Progress`) and its run clock (`runtime.run_clock.RunClock`), finished or stopped (`stopped`)."""
  hit, curve = progress.target_hit, progress.eval_curve
  parts = {k: round(v, 3) for k, v in clock.parts.items()}
  compile_s = progress.compile_s if progress.compile_s is not None else clock.now()  # stopped during start-up
  return RunSummary(env_steps=progress.env_steps,
                    iterations=progress.iterations,
                    wall_s=clock.now(),
                    compile_s=compile_s,
                    train_wall_s=progress.train_wall,
                    env_steps_per_s=progress.steps_this_session / max(progress.train_wall, 1e-9),
                    final_eval_return=curve[-1]['return'] if curve else None,
                    best_eval_return=max(e['return'] for e in curve) if curve else None,
                    target_return=cfg.schedule.target_return,
                    env_steps_to_target=hit[0] if hit else None,
                    wall_s_to_target=hit[1] if hit else None,
                    train_s_to_target=hit[2] if hit else None,
                    eval_curve=curve,
                    num_params=num_params,
                    schedule=cfg.schedule.name,
                    backend=cfg.sim.backend,
                    task=cfg.sim.task,
                    device=device,
                    extra=extra,
                    stopped=stopped,
                    compile_breakdown=parts,
                    start_unix=clock.start_unix)
