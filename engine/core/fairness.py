"""Fairness in the scheduler, between tenants (API keys) and between the requests of each: one request's many
sequences cannot starve a one-sequence request, and one key's many requests cannot starve another key's one.
Pure Python (kvscope.engine.core).

A *fairness group* is every sequence one client request asked for: all its prompts and all ``n`` choices of
each (``Request.fairness_key``: the HTTP request's id, set by the server; else the ``n > 1`` parent id; else
the sequence's own id). A *tenant* is whoever sent it (``Request.fairness_tenant_key``): the gateway's API key
name, which the gateway sends the engine in the ``x-kvscope-tenant`` header; without that header (a client
talking to the engine directly, or the gateway without keys) every group is its own tenant. The OpenAI body's
``user`` field is never a tenant: the client picks it. All sequences of a group have one tenant.

Shares. With ``T`` tenants holding unfinished sequences, a tenant's share of the running slots is
``max(1, max_num_seqs // T)``; inside a tenant with ``G`` such groups, a group's share is
``max(1, tenant share // G)``. A tenant's (group's) *excess* is what it runs minus its share. Without the
header every tenant has one group, and both shares are the plain ``max(1, max_num_seqs // groups)``.

Above all of this stands the request's admission class (``Request.schedule_class``: its service tier, then
its ``priority``; engine/core/admission.py): every sequence of one group has the same class, and the rules
below order the groups of one class; a better class always goes first. The
scheduler (engine/core/scheduler.py) applies four rules:

1. Admission order. The next waiting sequence admitted is the head (FCFS inside a group) of, in the best
   class waiting, in the tenant that runs the fewest sequences, the group that runs the fewest; ties go to
   the one whose candidate head is first in queue order (preempted sequences first, the latest preemption
   first, then arrival order). With one sequence per tenant and one class this is plain FCFS. Within a class
   this is the fairness between keys: a key that runs fewer sequences goes first, so of two keys sending
   alike one cannot take more than one slot ahead of the other's waiting requests.
2. Slots by share. A waiting group under its group share *claims* its waiting sequences up to what it lacks;
   a tenant claims the sum of its groups' claims, but at most what it lacks of its tenant share plus the
   excess of its own groups over their group share; only groups of the best tier waiting claim, and they
   take slots from sequences of that tier or a worse one. Before a step schedules anyone, while the claims
   exceed the free slots, a running sequence is preempted (by recompute, as the KV preemption): the newest
   one of, in the tenant furthest over its share, the group furthest over its group share; when no tenant is
   over its share, of the group furthest over its group share inside a claiming tenant. Those groups admit
   nobody in that step. Nothing is preempted from a tenant at or under its share whose groups are at or under
   theirs, so with one request per tenant a one-sequence request is never preempted by this rule.
3. Token budget round-robin. Running sequences get the step's tokens in rounds: every tenant's first running
   sequence, then every tenant's second, … (admission order inside a round), where a tenant's sequences are
   ordered the same way across its groups (every group's oldest running sequence, then every group's
   second, …). With one sequence per tenant this is admission order.
4. KV preemption. A running sequence that cannot get KV blocks preempts the newest not-yet-scheduled sequence
   of, in the tenant furthest over its share, the group furthest over its group share (when no tenant is
   over: of the group furthest over its group share), else (nobody over a share) the newest
   not-yet-scheduled sequence, itself included, as before.

What it does not bound: a waiting sequence still needs token budget left after the running ones (rule 3 orders
running sequences only) and free KV blocks (rule 4 frees them only when a running sequence asks); a slot freed
by rule 2 goes to whoever rule 1 names, which is the claimant unless a tenant running as few waits with groups
at their share.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Collection, Iterator, Sequence
from typing import NamedTuple

from kvscope.engine.core.request import Request


class FairShares:
    """Sequences per fairness group and per tenant, and the shares they give. The scheduler reports each
    change; groups (tenants) with no unfinished sequence are dropped, so the shares count only active ones.
    ``max_num_seqs``: the running slots shared (SchedulerConfig.max_num_seqs)."""

    def __init__(self, max_num_seqs: int) -> None:
        self._max_num_seqs = max_num_seqs
        self._unfinished: dict[str, int] = {}
        """Group → its waiting or running sequences."""
        self._running: dict[str, int] = {}
        """Group → its running sequences."""
        self._tenant_of: dict[str, str] = {}
        """Active group → its tenant key."""
        self._groups: dict[str, int] = {}
        """Tenant → its active groups."""
        self._tenant_running: dict[str, int] = {}
        self._started: set[str] = set()
        """Active groups with a sequence admitted once (it has had, or is about to have, a first token)."""

    def added(self, request: Request) -> None:
        """A sequence entered the scheduler. Raises ValueError when its group is active under another tenant
        (the server gives all sequences of one HTTP request one tenant); nothing is counted then."""
        group, tenant = request.fairness_key, request.fairness_tenant_key
        known = self._tenant_of.get(group)
        if known is None:
            self._tenant_of[group] = tenant
            self._groups[tenant] = self._groups.get(tenant, 0) + 1
        elif known != tenant:
            raise ValueError(
                f"request {request.request_id!r}: fairness group {group!r} belongs to tenant "
                f"{known!r}, not {tenant!r}"
            )
        self._unfinished[group] = self._unfinished.get(group, 0) + 1

    def admitted(self, request: Request) -> None:
        group = request.fairness_key
        self._running[group] = self._running.get(group, 0) + 1
        self._started.add(group)
        tenant = self._tenant_of[group]
        self._tenant_running[tenant] = self._tenant_running.get(tenant, 0) + 1

    def stopped_running(self, request: Request) -> None:
        """The request left the running list (preempted or finished)."""
        group = request.fairness_key
        _decrement(self._running, group)
        _decrement(self._tenant_running, self._tenant_of[group])

    def finished(self, request: Request) -> None:
        group = request.fairness_key
        if _decrement(self._unfinished, group) == 0:
            _decrement(self._groups, self._tenant_of.pop(group))
            self._started.discard(group)

    def started(self, group: str) -> bool:
        """Whether a sequence of active group ``group`` (one client request: its prompts and ``n`` choices)
        has been admitted: the client request's first token has come or is on its way."""
        return group in self._started

    def tenant_of(self, group: str) -> str:
        """The tenant key of active group ``group``."""
        return self._tenant_of[group]

    def running(self, group: str) -> int:
        """Running sequences of group ``group``."""
        return self._running.get(group, 0)

    def tenant_running(self, tenant: str) -> int:
        """Running sequences of tenant ``tenant``."""
        return self._tenant_running.get(tenant, 0)

    def running_groups(self) -> Iterator[tuple[str, int]]:
        """(group, running sequences) of every group running any."""
        return iter(self._running.items())

    def tenant_share(self) -> int:
        """Running slots per tenant: ``max(1, max_num_seqs // active tenants)``."""
        return max(1, self._max_num_seqs // max(1, len(self._groups)))

    def group_share(self, group: str) -> int:
        """Running slots of active group ``group``: ``max(1, tenant share // its tenant's active groups)``."""
        return max(1, self.tenant_share() // self._groups[self._tenant_of[group]])


def _decrement(counts: dict[str, int], key: str) -> int:
    """``counts[key] - 1``, the key dropped at zero; returns what is left."""
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
    return left


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
        return iter(
            sorted(
                (r for group in self._groups.values() for r in group),
                key=lambda r: self._position[r.request_id],
            )
        )

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


def claims(queue: WaitingQueue, shares: FairShares, tier_rank: int | None = None) -> tuple[int, set[str]]:
    """Rule 2's claims: (slots the waiting groups claim in all, the tenants claiming any). A group under its
    share claims its waiting sequences up to what it lacks; a tenant at most what it lacks of its share plus
    its groups' excess over theirs. ``tier_rank``: only groups of that tier claim (None: all)."""
    wanted: dict[str, int] = {}
    for group, waiting in queue.groups():
        if tier_rank is not None and waiting[0].schedule_class[0] != tier_rank:
            continue
        lack = shares.group_share(group) - shares.running(group)
        if lack > 0:
            tenant = shares.tenant_of(group)
            wanted[tenant] = wanted.get(tenant, 0) + min(len(waiting), lack)
    if not wanted:
        return 0, set()
    room = {tenant: max(0, shares.tenant_share() - shares.tenant_running(tenant)) for tenant in wanted}
    for group, running in shares.running_groups():
        tenant = shares.tenant_of(group)
        if tenant in room:
            room[tenant] += max(0, running - shares.group_share(group))
    return sum(min(want, room[tenant]) for tenant, want in wanted.items()), set(wanted)


class _Candidate(NamedTuple):
    """A heap entry of :class:`AdmissionOrder`: compared as a tuple, best admission class first, then fewest
    running, then queue order."""

    schedule_class: tuple[int, int]
    """The admission class (tier rank, priority) of its head sequence (a tenant: of its best group)."""
    running: int
    """Sequences the tenant (group) runs."""
    position: int
    """Queue position of its head sequence."""
    key: str
    """The tenant (group) key."""


class AdmissionOrder:
    """Rule 1 for one step: a heap of (best class, running sequences, candidate head's queue position, tenant)
    over the tenants with waiting sequences, each with a heap of (class, running sequences, head's queue
    position, group) over its waiting groups, minus ``excluded`` groups. :meth:`peek` names the next sequence
    to admit; call :meth:`admitted` once it is taken out of the queue and running."""

    def __init__(self, queue: WaitingQueue, shares: FairShares, excluded: Collection[str] = ()) -> None:
        self._queue = queue
        self._shares = shares
        self._groups: dict[str, list[_Candidate]] = {}
        for key, group in queue.groups():
            if key not in excluded:
                self._groups.setdefault(shares.tenant_of(key), []).append(
                    _Candidate(group[0].schedule_class, shares.running(key), queue.position(group[0]), key)
                )
        for heap in self._groups.values():
            heapq.heapify(heap)
        self._tenants = [
            _Candidate(heap[0].schedule_class, shares.tenant_running(tenant), heap[0].position, tenant)
            for tenant, heap in self._groups.items()
        ]
        heapq.heapify(self._tenants)

    def peek(self) -> Request | None:
        if not self._tenants:
            return None
        return self._queue.head(self._groups[self._tenants[0].key][0].key)

    def admitted(self, request: Request) -> None:
        tenant = heapq.heappop(self._tenants).key
        groups = self._groups[tenant]
        key = heapq.heappop(groups).key
        head = self._queue.head(key)
        if head is not None:
            heapq.heappush(
                groups,
                _Candidate(head.schedule_class, self._shares.running(key), self._queue.position(head), key),
            )
        if groups:
            heapq.heappush(
                self._tenants,
                _Candidate(
                    groups[0].schedule_class, self._shares.tenant_running(tenant), groups[0].position, tenant
                ),
            )


def round_robin(running: Sequence[Request]) -> list[Request]:
    """Rule 3: the running sequences in token order, every tenant's k-th sequence before any tenant's
    (k+1)-th, admission order inside a round; a tenant's sequences ranked the same way across its groups.
    ``running`` itself when no tenant runs two."""
    group_rounds: dict[str, int] = {}
    tenants: dict[str, list[tuple[int, int]]] = {}  # tenant -> (round in its group, position)
    for position, request in enumerate(running):
        key = request.fairness_key
        rank = group_rounds.get(key, 0)
        group_rounds[key] = rank + 1
        tenants.setdefault(request.fairness_tenant_key, []).append((rank, position))
    if len(tenants) == len(running):
        return list(running)
    ranked = []
    for members in tenants.values():
        members.sort()
        ranked.extend((rank, position) for rank, (_, position) in enumerate(members))
    return [running[position] for _, position in sorted(ranked)]


def fairness_victim(
    running: Sequence[Request],
    shares: FairShares,
    candidates: Collection[str] | None = None,
    claimants: Collection[str] | None = None,
) -> Request | None:
    """The preemption victim of rules 2 and 4: the newest running sequence (last in ``running``, admission
    order) whose id is in ``candidates`` (None: any) with the largest (tenant excess, group excess), among
    those whose tenant runs over its share or whose group runs over its group share (rule 2: a group of one
    of the ``claimants`` tenants; None: any). None when there is no such sequence."""
    tenant_share = shares.tenant_share()
    victim, worst = None, (0, 0)
    for request in reversed(running):
        if candidates is not None and request.request_id not in candidates:
            continue
        group = request.fairness_key
        tenant = shares.tenant_of(group)
        tenant_excess = shares.tenant_running(tenant) - tenant_share
        group_excess = shares.running(group) - shares.group_share(group)
        if tenant_excess <= 0 and (group_excess <= 0 or (claimants is not None and tenant not in claimants)):
            continue
        excess = (tenant_excess, group_excess)
        if victim is None or excess > worst:
            victim, worst = request, excess
    return victim
