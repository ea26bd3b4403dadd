"""Pytrees that cross stage and process boundaries. Named fields only, never anonymous tuples.

Axis names used in docstrings: `T` time (policy steps of one segment), `B` batch (envs or segments),
`K` action chunk length (1 for the MLP), `A` action dimension, `O` observation dimension, `H, W, C` a stacked
camera observation's height, width and channels (3 * frame_stack, 4 * frame_stack with --pixel_depth).

An observation `obs` is the state `[..., O]` float32, or with camera observations (`--obs=pixels`) a `PixelObs`
of pixels `[..., H, W, C]` uint8 beside that state: every record field that holds an observation (`Transition.obs`
and `next_obs`) holds the one or the other, and `obs_template` gives its shapes.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Tuple

import jax

Array = jax.Array
Params = Any
PRNGKey = jax.Array


class EnvSpec(NamedTuple):
  """Static facts about a task, shared by both simulator backends."""
  task: str
  obs_dim: int
  action_dim: int
  episode_length: int
  dt: float  # seconds of simulated time per env step (frame skip included)
  pixel_shape: Tuple[int, ...] = ()  # [H, W, C] of the stacked camera frames (--obs=pixels); () without pixels


class PixelObs(NamedTuple):
  """A camera observation: pixels [..., H, W, C] uint8 (frames stacked on C, oldest first) and the proprioceptive
  state [..., O] float32 beside them (O may be 0). The networks turn the pixels into floats; the observation
  normaliser sees the state only."""
  pixels: Array
  state: Array


def proprioception(obs) -> Any:
  """The state part of an observation: `obs.state` of a `PixelObs`, else `obs` itself."""
  return obs.state if isinstance(obs, PixelObs) else obs


def with_state(obs, state) -> Any:
  """`obs` with its state part replaced by `state` (a `PixelObs` keeps its pixels)."""
  return obs._replace(state=state) if isinstance(obs, PixelObs) else state


def obs_template(lead: Tuple[int, ...], obs_dim: int, pixel_shape: Tuple[int, ...] = ()) -> Any:
  """Shapes of observations with leading axes `lead`: the state [*lead, O] float32, or a `PixelObs` with pixels
  [*lead, H, W, C] uint8 beside it when `pixel_shape` is given (`jax.ShapeDtypeStruct` leaves)."""
  state = jax.ShapeDtypeStruct(tuple(lead) + (obs_dim,), jax.numpy.float32)
  if not pixel_shape:
    return state
  return PixelObs(pixels=jax.ShapeDtypeStruct(tuple(lead) + tuple(pixel_shape), jax.numpy.uint8), state=state)


class ActOutput(NamedTuple):
  """What the generation stage returns for a batch of observations.

  actions:   [B, K, A] in [-1, 1] (tanh-squashed, or the token policy's bin centres), executed over the next K
             env steps.
  raw_actions: [B, K, A] float32, what log-probs are recomputed from during training: pre-tanh Gaussian samples,
             or the token policy's bin ids as float32 (exact below 2^24; its evaluate casts them to int32).
  log_probs: [B] log-probability of the whole chunk (sum over K and A).
  values:    [B] critic value of the observation (zeros for critic-free policies).
  """
  actions: Array
  raw_actions: Array
  log_probs: Array
  values: Array


class Transition(NamedTuple):
  """One policy step (one action chunk) for a batch of envs; stacked over time it is a trajectory segment.

  Shapes for a segment: obs/next_obs [T, B, O] (or a `PixelObs`: pixels [T, B, H, W, C] uint8, state
  [T, B, O]); raw_action [T, B, K, A]; reward, termination, truncation,
  behaviour_log_prob, mask [T, B]; policy_version [T, B] (int32).
  raw_action is `ActOutput.raw_actions`, float32 for every policy (the segment spec and shared memory are
  float32): for the token policy it holds bin ids, exact in float32 below 2^24, cast back to int32 inside the
  token policy's evaluate.
  reward is summed over the K env steps of the chunk. termination is 1 where the episode ended by failure
  (no bootstrap), truncation 1 where it was cut by the time limit. mask is 0 on steps past the end of an
  episode in episodic (GRPO) rollouts and 1 everywhere else.
  """
  obs: Array
  raw_action: Array
  reward: Array
  termination: Array
  truncation: Array
  next_obs: Array
  behaviour_log_prob: Array
  mask: Array
  policy_version: Array


# A segment's ranks: (T, S) first in every field, then the observation's [O], the action chunk's [K, A].
_SEGMENT_RANKS = {
    'raw_action': 4,
    'reward': 2,
    'termination': 2,
    'truncation': 2,
    'behaviour_log_prob': 2,
    'mask': 2,
    'policy_version': 2
}


def check_segment(batch: Transition) -> Tuple[int, int]:
  """(T, S) of a segment batch, its shapes checked (at trace time: they are static): ValueError naming the field
  whose rank is off, whose leading axes are not reward's [T, S], or, for next_obs, whose shapes differ from
  obs's (`losses` bootstraps from next_obs[-1]: a [T + 1, ...] stack would bootstrap from the wrong step)."""
  shapes = {name: [tuple(x.shape) for x in jax.tree.leaves(getattr(batch, name))] for name in Transition._fields}
  if len(shapes['reward'][0]) != 2:
    raise ValueError(f'Transition.reward must be [T, S]; got shape {shapes["reward"][0]}.')
  lead = shapes['reward'][0]
  for name, found in shapes.items():
    rank = _SEGMENT_RANKS.get(name)
    state = tuple(getattr(proprioception(getattr(batch, name)), 'shape', ())) if rank is None else None
    if rank is not None and len(found[0]) != rank or state is not None and len(state) != 3:
      raise ValueError(f'Transition.{name} has shape {state or found[0]}; a segment\'s is '
                       f'{"[T, S, K, A]" if name == "raw_action" else "[T, S]" if rank else "[T, S, O]"}.')
    for shape in found:
      if shape[:2] != lead:
        raise ValueError(f'Transition.{name} has shape {shape}; every field leads with reward\'s [T, S] = '
                         f'{list(lead)}.')
  if shapes['next_obs'] != shapes['obs']:
    raise ValueError(f'Transition.next_obs has shape(s) {shapes["next_obs"]}, obs {shapes["obs"]}: each step\'s '
                     'next observation, the same shapes as obs (not a [T + 1, ...] stack).')
  return lead


class StepResult(NamedTuple):
  """What one env step returns for a batch of envs (both backends, numpy or jax arrays).

  obs [B, O] is the observation to act on next: after an episode ends it is already the reset observation.
  reward, done, truncation [B]: done is 1 when the episode ended (failure or time limit); truncation is 1 when
  it ended by the time limit alone. episode_return, episode_length [B] hold the finished episode's totals where
  done is 1 (and are meaningless elsewhere).
  """
  obs: Any
  reward: Any
  done: Any
  truncation: Any
  episode_return: Any
  episode_length: Any


class EpisodeStats(NamedTuple):
  """Sums over the episodes that ended during a collection: return_sum / count is the mean training return.
  Scalars (jax arrays inside jitted code, floats on the host)."""
  return_sum: Any
  length_sum: Any
  count: Any


class SegmentRecord(NamedTuple):
  """One env group's share of an iteration, as it crosses from a rollout worker to the trainer.

  transition: a `Transition` with leading [T, S_g] (S_g = the group's segments). group, iteration, incarnation:
  [1] int32 — which group, that group's iteration counter, and which start of the group's worker (0 first, +1
  per restart); the triple is unique, so the trainer counts any record it sees twice. episode_stats: an
  `EpisodeStats` of [] float32 sums over the episodes that ended in the segment.
  """
  transition: Transition
  group: Any
  iteration: Any
  incarnation: Any
  episode_stats: EpisodeStats


def transition_template(t: int,
                        s: int,
                        obs_dim: int,
                        action_chunk: int,
                        action_dim: int,
                        pixel_shape: Tuple[int, ...] = ()) -> Transition:
  """Shapes and dtypes of a [T, S] segment (`jax.ShapeDtypeStruct` leaves): the one definition that buffers,
  shared-memory specs and the memory plan derive from. With `pixel_shape`, obs and next_obs are `PixelObs`."""
  f32, i32 = jax.numpy.float32, jax.numpy.int32
  steps = jax.ShapeDtypeStruct((t, s), f32)
  obs = obs_template((t, s), obs_dim, pixel_shape)
  return Transition(obs=obs,
                    raw_action=jax.ShapeDtypeStruct((t, s, action_chunk, action_dim), f32),
                    reward=steps,
                    termination=steps,
                    truncation=steps,
                    next_obs=obs,
                    behaviour_log_prob=steps,
                    mask=steps,
                    policy_version=jax.ShapeDtypeStruct((t, s), i32))


def segment_template(t: int,
                     s: int,
                     obs_dim: int,
                     action_chunk: int,
                     action_dim: int,
                     pixel_shape: Tuple[int, ...] = ()) -> SegmentRecord:
  """Shapes and dtypes of one env group's `SegmentRecord` (`jax.ShapeDtypeStruct` leaves)."""
  index = jax.ShapeDtypeStruct((1,), jax.numpy.int32)
  stat = jax.ShapeDtypeStruct((), jax.numpy.float32)
  return SegmentRecord(transition=transition_template(t, s, obs_dim, action_chunk, action_dim, pixel_shape),
                       group=index,
                       iteration=index,
                       incarnation=index,
                       episode_stats=EpisodeStats(stat, stat, stat))


class ActRequest(NamedTuple):
  """Sim worker -> generation worker: the observations of one slice of an env group (the whole group unless
  `--env_slices` > 1). group, env_slice, seq: [] int32 (seq numbers the slice's requests, so a reply to a
  re-sent request can be told apart); min_version: [] int32, the oldest policy version the slice may act with
  (its group's staleness bound); obs [B_s, O] (B_s envs per slice; [0, O] over CUDA IPC, where they lie in the
  slice's device buffer); key [2] uint32, the step's sampling key (an MJX group's, so a served step samples what
  a co-located one would); owner [] int32, the requester's pid, and handle [64] uint8, its CUDA IPC buffer's
  handle (zeros on the host path)."""
  group: Any
  env_slice: Any
  seq: Any
  min_version: Any
  obs: Any
  key: Any
  owner: Any
  handle: Any


class ActReply(NamedTuple):
  """Generation worker -> sim worker: actions [B_s, K, A], raw_actions [B_s, K, A], log_probs [B_s], and the
  policy version that produced them ([] int32); group, env_slice and seq echo the request. Over CUDA IPC the
  three arrays have 0 rows: they lie in the requester's device buffer."""
  group: Any
  env_slice: Any
  seq: Any
  version: Any
  actions: Any
  raw_actions: Any
  log_probs: Any


class EvalReport(NamedTuple):
  """Evaluator process -> trainer: the evaluation of one published policy version. version: [] int64 (the
  trainer iteration it was published at, which also picks the evaluation's key); episode_return, episode_length:
  [] float64, the means over the evaluation's episodes (what the in-trainer evaluation returns, bit for bit);
  seconds: [] float64, how long the evaluation took; unix: [] float64, `time.time()` when it finished."""
  version: Any
  episode_return: Any
  episode_length: Any
  seconds: Any
  unix: Any
