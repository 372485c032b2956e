"""Fairness between requests in the scheduler: one request's many sequences cannot starve a one-sequence
request. Pure Python (engine.core).

A *fairness group* is every sequence one client request asked for: all its prompts and all ``n`` choices of
each (``Request.fairness_key``: the HTTP request's id, set by the server; else the ``n > 1`` parent id; else the
sequence's own id). With ``G`` groups holding unfinished sequences, a group's *share* of the running slots is
``max(1, max_num_seqs // G)``. The scheduler (engine/core/scheduler.py) applies four rules:

1. Admission order. The next waiting sequence admitted is the head (FCFS inside a group) of the group that runs
   the fewest sequences; ties go to the group whose head is first in queue order (preempted sequences first,
   the latest preemption first, then arrival order). With one sequence per group this is plain FCFS.
2. Slots by share. Before a step schedules anyone, while the groups running fewer than their share wait with
   more sequences (counted up to their share) than there are free slots, the newest running sequence of the
   group furthest over its share is preempted (by recompute, as the KV preemption). Those groups admit nobody
   in that step. No group is preempted down below its share, so one-sequence requests are never preempted by
   this rule.
3. Token budget round-robin. Running sequences get the step's tokens in rounds: every group's oldest running
   sequence, then every group's second, … (admission order inside a round). With one sequence per group this is
   admission order.
4. KV preemption. A running sequence that cannot get KV blocks preempts the newest not-yet-scheduled sequence
   of the group furthest over its share, else (no group over its share) the newest not-yet-scheduled
   sequence, itself included, as before.

What it does not bound: a waiting sequence still needs token budget left after the running ones (rule 3 orders
running sequences only) and free KV blocks (rule 4 frees them only when a running sequence asks).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Collection, Iterator, Sequence

from engine.core.request import Request


class GroupCounts:
    """Sequences per fairness group: unfinished (waiting or running) and running. The scheduler reports each
    change; groups with no unfinished sequence are dropped, so ``len`` counts the active groups."""

    def __init__(self) -> None:
        self._unfinished: dict[str, int] = {}
        self._running: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._unfinished)

    def added(self, request: Request) -> None:
        key = request.fairness_key
        self._unfinished[key] = self._unfinished.get(key, 0) + 1

    def admitted(self, request: Request) -> None:
        key = request.fairness_key
        self._running[key] = self._running.get(key, 0) + 1

    def stopped_running(self, request: Request) -> None:
        """The request left the running list (preempted or finished)."""
        _decrement(self._running, request.fairness_key)

    def finished(self, request: Request) -> None:
        _decrement(self._unfinished, request.fairness_key)

    def running(self, key: str) -> int:
        """Running sequences of group ``key``."""
        return self._running.get(key, 0)

    def share(self, max_num_seqs: int) -> int:
        """Running slots per group: ``max(1, max_num_seqs // active groups)``."""
        return max(1, max_num_seqs // max(1, len(self._unfinished)))


def _decrement(counts: dict[str, int], key: str) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]


class WaitingQueue:
    """The scheduler's waiting sequences: FCFS inside each fairness group. Each sequence gets a queue position
    when it enters (``append``: after everyone; ``appendleft``: before everyone, for a preempted one), so
    iterating yields the order of the single FCFS deque this replaces."""

    def __init__(self) -> None:
        self._groups: dict[str, deque[Request]] = {}
        self._position: dict[str, int] = {}
        self._back = 0
        self._front = 0

    def __len__(self) -> int:
        return len(self._position)

    def __iter__(self) -> Iterator[Request]:
        """Every waiting sequence in queue order (sorts: for tests and inspection, not the step)."""
        return iter(sorted((r for group in self._groups.values() for r in group),
                           key=lambda r: self._position[r.request_id]))

    def append(self, request: Request) -> None:
        self._position[request.request_id] = self._back
        self._back += 1
        self._groups.setdefault(request.fairness_key, deque()).append(request)

    def appendleft(self, request: Request) -> None:
        self._front -= 1
        self._position[request.request_id] = self._front
        self._groups.setdefault(request.fairness_key, deque()).appendleft(request)

    def remove(self, request: Request) -> None:
        """Take ``request`` out (admitted, finished or aborted). Raises KeyError if it is not waiting."""
        key = request.fairness_key
        group = self._groups[key]
        if group[0] is request:
            group.popleft()
        else:
            group.remove(request)
        if not group:
            del self._groups[key]
        del self._position[request.request_id]

    def head(self, key: str) -> Request | None:
        group = self._groups.get(key)
        return group[0] if group else None

    def position(self, request: Request) -> int:
        return self._position[request.request_id]

    def groups(self) -> Iterator[tuple[str, deque[Request]]]:
        return iter(self._groups.items())

    def demand(self, counts: GroupCounts, share: int) -> int:
        """Slots the groups under their share would take: per such group, its waiting sequences up to what it
        lacks of its share (rule 2)."""
        return sum(min(len(group), share - counts.running(key)) for key, group in self._groups.items()
                   if counts.running(key) < share)


class AdmissionOrder:
    """Rule 1 for one step: a heap of (running sequences, head's queue position, group) over the groups with
    waiting sequences, minus ``excluded`` groups. :meth:`peek` names the next sequence to admit; call
    :meth:`admitted` once it is taken out of the queue and running."""

    def __init__(self, queue: WaitingQueue, counts: GroupCounts, excluded: Collection[str] = ()) -> None:
        self._queue = queue
        self._counts = counts
        self._heap = [(counts.running(key), queue.position(group[0]), key) for key, group in queue.groups()
                      if key not in excluded]
        heapq.heapify(self._heap)

    def peek(self) -> Request | None:
        return self._queue.head(self._heap[0][2]) if self._heap else None

    def admitted(self, request: Request) -> None:
        key = heapq.heappop(self._heap)[2]
        head = self._queue.head(key)
        if head is not None:
            heapq.heappush(self._heap, (self._counts.running(key), self._queue.position(head), key))


def round_robin(running: Sequence[Request]) -> list[Request]:
    """Rule 3: the running sequences in token order, every group's k-th sequence before any group's
    (k+1)-th, admission order inside a round. ``running`` itself when no group runs two."""
    rounds: dict[str, int] = {}
    ranked = []
    for position, request in enumerate(running):
        key = request.fairness_key
        rank = rounds.get(key, 0)
        rounds[key] = rank + 1
        ranked.append((rank, position))
    if len(rounds) == len(running):
        return list(running)
    return [running[position] for _, position in sorted(ranked)]


def newest_over_share(running: Sequence[Request], counts: GroupCounts, share: int,
                      candidates: Collection[str] | None = None) -> Request | None:
    """The preemption victim of rules 2 and 4: of the group furthest over its ``share`` (most running
    sequences beyond it), the newest running sequence (last in ``running``, admission order) whose id is in
    ``candidates`` (None: any). None when no candidate's group runs more than its share."""
    victim, worst = None, 0
    for request in reversed(running):
        if candidates is not None and request.request_id not in candidates:
            continue
        excess = counts.running(request.fairness_key) - share
        if excess > worst:
            victim, worst = request, excess
    return victim
