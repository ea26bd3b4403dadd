"""Transport interfaces: `Channel` (FIFO of fixed-shape records), `ParamStore` (latest policy parameters) and
`Mailbox` (request/response between env groups and a generation server, built on channels).

Ownership of data: `put` copies the record into the channel, so the caller may reuse its arrays at once; `get`
returns a fresh record whose arrays the caller owns (one copy out of the slot; no `release()` to forget).
Records with the same field names, shapes and dtypes as the channel's `RecordSpec` are accepted; anything else
is a `ValueError` that names the field. Jax arrays are accepted too (copied to the host).

NOTE: closing is abortive for producers and draining for consumers: after `close()`, `put` raises
`ChannelClosed`; `get` still returns records already in the channel, then raises `ChannelClosed`. `close()` wakes
every blocked `put`/`get`, in any process. It is idempotent and callable from any thread or process.

NOTE: liveness. `TimeoutError` means only "no record (or no room) yet": the caller may wait again. A wait that
can never succeed because the process at the other end is gone ends in `PeerDied` instead (a `ChannelClosed`,
so a loop that stops on a closed channel stops on it too), and a lock that a live peer keeps past its bound in
`PeerStuck`. No implementation waits forever on a lock a dead process held.
"""
from __future__ import annotations

import abc
import time
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

from ebrl_jax.transport.specs import RecordSpec


class ChannelClosed(Exception):
  """Raised by put/get on a closed channel (get: once the channel is also empty)."""


class PeerDied(ChannelClosed):
  """A wait ended because a peer it depends on is gone for good (the process that created the channel or store
  died), not because no data has come yet (that is `TimeoutError`)."""


class PeerStuck(RuntimeError):
  """A live process held a transport lock past its bound (it is stopped or hung). A dead holder never blocks
  anyone: its locks are released with it."""


class Recovered(NamedTuple):
  """What a channel or parameter store recovered from dead peers so far: `slots` a dead peer held mid-put or
  mid-get (for a parameter store: buffers it left half-written), `locks` found left by a holder that died holding
  them. Always zero for implementations whose peers are threads of one process."""
  slots: int = 0
  locks: int = 0


class Channel(abc.ABC):
  """A bounded FIFO of records of one `RecordSpec`. Many producers and many consumers may share it.

  FIFO means records come out in the order their `put`s completed (per producer: in the order it put them).
  """
  spec: RecordSpec
  capacity: int

  @abc.abstractmethod
  def put(self, record: Any, timeout: Optional[float] = None) -> None:
    """Copies `record` in; blocks while full. Raises ChannelClosed, TimeoutError, or ValueError (bad record)."""

  @abc.abstractmethod
  def get(self, timeout: Optional[float] = None) -> Any:
    """Next record (a copy the caller owns); blocks while empty. Raises ChannelClosed or TimeoutError."""

  def get_nowait(self) -> Any:
    """Next record without blocking. Raises `Empty` if none is ready (or ChannelClosed)."""
    try:
      return self.get(timeout=0)
    except TimeoutError:
      raise Empty() from None

  def try_get(self) -> Optional[Any]:
    """Next record, or None if none is ready. Raises ChannelClosed once closed and drained."""
    try:
      return self.get(timeout=0)
    except TimeoutError:
      return None

  def get_many(self, max_records: int, timeout: Optional[float] = None) -> List[Any]:
    """Blocks (up to `timeout`) for one record, then takes up to `max_records - 1` more that are ready."""
    records = [self.get(timeout)]
    while len(records) < max_records:
      try:
        record = self.try_get()
      except ChannelClosed:
        break
      if record is None:
        break
      records.append(record)
    return records

  @abc.abstractmethod
  def qsize(self) -> int:
    """Approximate number of records in the channel."""

  @abc.abstractmethod
  def close(self) -> None:
    """Marks the channel closed for every party and wakes all blocked callers."""

  def recovered(self) -> Recovered:
    """Slots and locks recovered from dead peers so far, by any party."""
    return Recovered()

  @property
  @abc.abstractmethod
  def closed(self) -> bool:
    """Whether `close()` has been called (by anyone)."""


class Empty(TimeoutError):
  """`get_nowait` found no record ready."""


class ParamStore(abc.ABC):
  """Latest policy parameters: one writer publishes versions, any number of readers take the latest.

  The template pytree (treedef + leaf shapes/dtypes) is fixed at construction. Readers never see a torn set:
  every leaf of a returned set comes from the same `publish`. Versions must strictly increase.
  """

  @abc.abstractmethod
  def publish(self, version: int, params: Any) -> None:
    """Copies `params` (a pytree matching the template) in as `version`. ValueError on mismatch or old version."""

  @abc.abstractmethod
  def latest(self) -> Tuple[int, Any]:
    """(version, params) of the newest publish; params are arrays the caller may keep (treat as read-only).

    Raises LookupError if nothing has been published yet.
    """

  @abc.abstractmethod
  def version(self) -> int:
    """Version of the newest publish, -1 before the first. Cheap: poll it, then call `latest()` when it moves."""

  def get(self, version: int) -> Any:
    """The params of `version` if the store still holds it (a store made with `history` h holds the newest h
    versions); LookupError otherwise. This default holds the newest only."""
    held, params = self.latest()
    if held != version:
      raise LookupError(f'parameter version {version} is not held (the store keeps the newest only: {held}).')
    return params

  def wait_for_version(self,
                       min_version: int,
                       timeout: Optional[float] = None,
                       poll_s: float = 1e-3) -> Tuple[int, Any]:
    """Polls until `version() >= min_version`, then returns `latest()`. Raises TimeoutError."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while self.version() < min_version:
      if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError(f'parameter version {min_version} not published within {timeout} s '
                           f'(latest is {self.version()}).')
      time.sleep(poll_s)
    return self.latest()

  def recovered(self) -> Recovered:
    """Half-written buffers and locks recovered from dead publishers so far."""
    return Recovered()

  def close(self) -> None:
    """Releases this process's resources (the owner's registry frees shared memory)."""


class Mailbox:
  """Request/response between many env groups and one generation server: the cheapest form is one shared request
  channel (many producers) plus one reply channel per requester (single producer, single consumer).

  Each request record carries its group id in the integer field `group_field` (shape ()), so the server knows
  where to reply. A group may be split into `num_slices` requesters (slices of its envs), each with its own reply
  channel; then requests also carry the slice in `slice_field`, and replies go to (group, slice). The server
  batches whichever requesters are ready with `gather`. A requester has at most one request outstanding, so
  reply channels need capacity 1. `replies` is ordered group-major: the channel of (g, s) is g * num_slices + s.
  """

  def __init__(self,
               requests: Channel,
               replies: Sequence[Channel],
               group_field: str = 'group',
               num_slices: int = 1,
               slice_field: Optional[str] = None):
    for field in filter(None, (group_field, slice_field)):
      if field not in requests.spec or requests.spec[field].shape != ():
        raise ValueError(f'request spec {requests.spec} needs a scalar integer field {field!r}.')
    if num_slices < 1 or len(replies) % num_slices:
      raise ValueError(f'num_slices={num_slices} must be >= 1 and divide the {len(replies)} reply channels.')
    if num_slices > 1 and slice_field is None:
      raise ValueError(f'num_slices={num_slices} needs a slice_field naming the slice in each request.')
    self.requests = requests
    self.replies = list(replies)
    self.group_field, self.slice_field, self.num_slices = group_field, slice_field, num_slices

  @property
  def num_groups(self) -> int:
    return len(self.replies) // self.num_slices

  def _channel(self, group: int, env_slice: int) -> Channel:
    if not 0 <= group < self.num_groups:
      raise ValueError(f'{self.group_field}={group} is outside [0, {self.num_groups}).')
    if not 0 <= env_slice < self.num_slices:
      raise ValueError(f'{self.slice_field or "slice"}={env_slice} is outside [0, {self.num_slices}).')
    return self.replies[group * self.num_slices + env_slice]

  def slice_of(self, request: Any) -> int:
    """The slice a request comes from (0 without a slice field)."""
    return int(getattr(request, self.slice_field)) if self.slice_field else 0

  def ask(self, request: Any, timeout: Optional[float] = None) -> None:
    """Sim side: sends a request for group `request.<group_field>` (slice `request.<slice_field>`)."""
    self._channel(int(getattr(request, self.group_field)), self.slice_of(request))  # checks the address
    self.requests.put(request, timeout)

  def receive(self, group: int, timeout: Optional[float] = None, env_slice: int = 0) -> Any:
    """Sim side: waits for the reply to the outstanding request of group `group`, slice `env_slice`."""
    return self._channel(group, env_slice).get(timeout)

  def gather(self, max_requests: int, timeout: Optional[float] = None) -> List[Tuple[int, Any]]:
    """Server side: blocks for one request, then takes up to `max_requests - 1` more that are ready.

    Returns [(group, request), ...] in arrival order (the slice is `slice_of(request)`).
    """
    return [(int(getattr(r, self.group_field)), r) for r in self.requests.get_many(max_requests, timeout)]

  def reply(self, group: int, response: Any, timeout: Optional[float] = None, env_slice: int = 0) -> None:
    """Server side: sends the response for group `group`, slice `env_slice`."""
    self._channel(group, env_slice).put(response, timeout)

  def close(self) -> None:
    self.requests.close()
    for channel in self.replies:
      channel.close()
