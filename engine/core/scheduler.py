"""Continuous-batching scheduler in the vLLM v1 model. Pure Python.

There is no prefill or decode phase (vLLM v1 ``vllm/v1/core/sched/scheduler.py``): every request has
``num_computed_tokens`` and each step hands out ``max_num_batched_tokens`` tokens, first to running requests
(in admission order), then to waiting ones (FCFS), at most ``max_num_seqs`` requests. A request gets
``num_tokens - num_computed_tokens`` tokens, capped by the budget left (chunked prefill) and by
``long_prefill_token_threshold``. When a running request cannot get blocks, the newest running request is
preempted by recompute (blocks freed, back to the front of the waiting queue) until it fits.

Fairness between tenants and between client requests (engine/core/fairness.py, which states the rules): the
sequences of one client request (its prompts and ``n`` choices; ``Request.fairness_key``) form a group, the
groups of one API key (``Request.fairness_tenant_key``; else each group alone) a tenant; a tenant gets
``max(1, max_num_seqs // active tenants)`` running slots while others wait, and its groups split that share.
"Admission order" above is round-robin across tenants, then groups, "FCFS" is FCFS inside a group with the
tenant, then the group, running the fewest sequences going first, a step starts by preempting the newest
sequences of tenants (groups) over their share when others under it wait for slots, and the KV victim is taken
from the tenant, then the group, furthest over its share first. With one sequence per tenant all of this is
the plain order above: nothing is preempted for fairness.

Tiers and priorities (engine/core/admission.py, issue 42): the waiting requests are admitted by admission
class first (``Request.schedule_class``: service tier, then ``priority``), the rules above ordering those of
one class; while waiting requests of a better tier find no free running slot, the newest running requests of
a deferrable tier (``flex``) are preempted for them. Each new request gets a predicted time to first token
(:meth:`Scheduler.predict_ttft`, engine/core/ttft.py) from the queues and the step-time model the scheduler
fits on its own step records; a request whose deadline passes while it still waits for its first admission
is dropped before any prefill (:meth:`Scheduler.expire_waiting`), and so is one whose first token can no
longer come within its tier's objective when admission is on (:meth:`Scheduler.shed_overdue`).
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvscope.engine.config import CacheConfig, SchedulerConfig
from kvscope.engine.core.admission import DEFERRABLE_TIERS, TIER_RANK
from kvscope.engine.core.attribution import BlockedSteps, QueueLimit
from kvscope.engine.core.drafter import Drafter
from kvscope.engine.core.fairness import (
    AdmissionOrder,
    FairShares,
    WaitingQueue,
    claims,
    fairness_victim,
    round_robin,
)
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.core.request import Request, RequestStatus, child_request_id
from kvscope.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvscope.engine.core.stats import SchedulerStats
from kvscope.engine.core.ttft import (
    MAX_REPLAYED_AHEAD,
    ArrivalStream,
    OutputLengths,
    RecentArrivals,
    StepLimits,
    StepTime,
    StepTimeModel,
    TtftCalibration,
    TtftPrediction,
    replay_ttft,
    running_sequence,
    waiting_sequence,
)
from kvscope.engine.errors import PromptTooLongError


@dataclass(slots=True)
class _StepPlan:
    """What one schedule() call decided, before the output is built."""

    token_budget: int
    entries: list[tuple[Request, int, bool, list[int]]] = field(default_factory=list)
    """(request, num_new_tokens, is_new, draft tokens), running requests first."""
    preempted_req_ids: set[str] = field(default_factory=set)
    """Preempted for KV blocks while scheduling the running requests: no waiting request is admitted."""
    rebalanced_req_ids: set[str] = field(default_factory=set)
    """Preempted at the step's start for fairness (rule 2 of engine/core/fairness.py) or for a better
    tier."""

    def add(
        self, request: Request, num_new_tokens: int, is_new: bool, draft: list[int] | None = None
    ) -> None:
        self.entries.append((request, num_new_tokens, is_new, draft or []))
        self.token_budget -= num_new_tokens + len(draft or ())


class Scheduler:
    """Decides which requests run each step and how many tokens each computes.

    ``clock`` (seconds, monotonic) timestamps request stats; tests may inject a fake one. ``step_time``:
    the step-time model of the TTFT prediction (default: a :class:`StepTimeModel` fitted on this scheduler's
    steps); tests script one.
    Raises ValueError when the KV cache cannot hold one ``max_model_len`` sequence (a request that can never
    fit would wait forever), as vLLM checks at start-up.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        drafter: Drafter | None = None,
        step_time: StepTime | None = None,
        ttft_objectives: Mapping[str, float] | None = None,
    ) -> None:
        capacity = kv_cache_manager.block_pool.num_blocks * kv_cache_manager.block_size
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
        if capacity < max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens, fewer than max_model_len={max_model_len}; "
                "raise the KV cache memory or lower max_model_len"
            )
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.clock = clock
        self.drafter = drafter
        """Speculative decoding's draft source; None = no drafts."""
        self.requests: dict[str, Request] = {}
        """Unfinished requests by id."""
        self.waiting = WaitingQueue()
        """FCFS per fairness group; iterates in queue order (engine/core/fairness.py)."""
        self.running: list[Request] = []
        """In admission order."""
        self._shares = FairShares(scheduler_config.max_num_seqs)
        self._finished_req_ids: set[str] = set()
        self._num_preemptions_total = 0
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        self._blocked_steps = BlockedSteps()
        """Steps that left requests waiting, per limit (attribution; engine/core/attribution.py)."""
        self.step_time: StepTime = step_time if step_time is not None else StepTimeModel()
        """Seconds of a step by its shape, fitted on the steps' records (engine/core/ttft.py)."""
        self.output_lengths = OutputLengths()
        """The output length the TTFT prediction expects, from the requests finished lately."""
        self.arrivals = RecentArrivals()
        """The requests queued lately per tier: the better tiers' arrivals the TTFT prediction expects."""
        self.ttft_calibration = TtftCalibration()
        """Actual / predicted TTFT of the recent first tokens per tier (admission scales predictions)."""
        self._busy_since: float | None = None
        """When the previous step's output was applied, while requests were left (the next step's period
        starts there)."""
        self._deadlines: list[tuple[float, str]] = []
        """(deadline, request id) of waiting requests with a deadline, a heap (finished ones left in it)."""
        self.ttft_objectives: Mapping[str, float] = dict(ttft_objectives or {})
        """Tier → TTFT objective (s) of admission (``--ttft-slo``): a waiting request of such a tier is
        dropped once its first token can no longer come within it (:meth:`shed_overdue`); empty: never."""
        self._overdue_at: list[tuple[float, str]] = []
        """(when to look again, request id) of the waiting requests of a tier with an objective, a heap
        (finished and admitted ones left in it): arrival + objective - the steps of its own prefill, as
        last estimated."""

    # ---- request lifecycle -------------------------------------------------------------------------------

    def add_request(self, request: Request, prediction: TtftPrediction | None = None) -> None:
        """Queue a request (status WAITING) with its TTFT ``prediction`` (None: predicted here,
        :meth:`predict_ttft`; the siblings of one request share one). Raises ValueError for a duplicate id,
        an empty prompt, an unknown tier or a fairness group already queued under another tenant, and
        PromptTooLongError when the prompt exceeds ``max_model_len``: invariants, not user-facing checks (the
        engine's InputProcessor rejected such requests before they became Requests)."""
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already in the scheduler")
        if request.num_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.num_tokens > self.max_model_len:
            raise PromptTooLongError(
                max_model_len=self.max_model_len, num_prompt_tokens=request.num_tokens, max_tokens=None
            )
        if request.service_tier not in TIER_RANK:
            raise ValueError(f"request {request.request_id!r} has an unknown tier {request.service_tier!r}")
        if not self.has_unfinished_requests():
            self._busy_since = None  # the engine idled: the next step's period starts at its scheduling
        if prediction is None:
            prediction = self.predict_ttft(request)
        else:
            request.foreseen_cached_tokens = prediction.cached_tokens
        self._shares.added(request)
        request.status = RequestStatus.WAITING
        request.stats.num_prompt_tokens = request.num_prompt_tokens
        request.stats.predicted_ttft_s = prediction.seconds
        request.stats.service_tier = request.service_tier
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, request.request_id))
        objective = self.ttft_objectives.get(request.service_tier)
        if objective is not None:
            own_s = self._first_steps_s(request.num_tokens - request.foreseen_cached_tokens)
            heapq.heappush(self._overdue_at, (request.arrival_time + objective - own_s, request.request_id))
        request.stats.attribution.on_arrival(len(self.waiting), len(self.running), self._blocked_steps)
        self.arrivals.observe(
            request.schedule_class[0],
            self.clock(),
            max(request.num_tokens - request.foreseen_cached_tokens, 1),
            request.max_tokens,
        )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(
        self, request_id: str, status: RequestStatus, num_output_tokens: int | None = None
    ) -> Request | None:
        """Finish a request from outside (stop string matched, client gone) in any state: it leaves its
        queue and its blocks are freed. ``num_output_tokens``: keep only that many output tokens (a stop
        string ended inside a run of accepted draft tokens; the later ones are dropped). Returns the
        request, or None for an unknown or finished id. Raises ValueError when ``status`` is not a finished
        status."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        request = self.requests.get(request_id)
        if request is None:
            return None
        if num_output_tokens is not None:
            request.truncate_output(num_output_tokens)
        self._finish(request, status, self.clock())
        return request

    def predict_ttft(self, request: Request) -> TtftPrediction:
        """Seconds from ``request``'s arrival to its first token if it were queued now (engine/core/ttft.py):
        the running requests, then the waiting ones of its admission class or a better one in admission order,
        replayed step by step under this scheduler's limits and priced by :attr:`step_time`, plus the time
        since its arrival. Requests of better tiers are expected to keep arriving at the rate and size
        :attr:`arrivals` measured over its window and to be admitted before it (:class:`ArrivalStream`; none
        for the best tier). Its prompt's blocks the prefix cache holds now are not computed (their count is
        kept in ``request.foreseen_cached_tokens`` for the predictions of later requests). Changes nothing
        else. Cost: O(running x steps replayed), the steps bounded by replaying at most
        MAX_REPLAYED_AHEAD requests ahead (a longer queue is extrapolated linearly from them) and
        MAX_INJECTED_ARRIVALS expected arrivals; nothing is replayed while the step-time model has no
        fit."""
        _, hit = self.kv_cache_manager.get_computed_blocks(request)
        request.foreseen_cached_tokens = hit
        cls = request.schedule_class
        queue = self.waiting
        ahead = [r for _, group in queue.groups() for r in group if r.schedule_class <= cls]
        if self.step_time.predict(0, 1, 0) is None:  # no fit yet: nothing to price the replay with
            return TtftPrediction(None, len(ahead), 0, len(self.running), hit)
        ahead.sort(key=lambda r: (r.schedule_class, queue.position(r)))
        lengths = self.output_lengths
        running = [
            running_sequence(r, lengths.expected(r.max_tokens)) for r in self._kept_running(cls, len(ahead))
        ]
        replayed = [
            waiting_sequence(r, lengths.expected(r.max_tokens), r.foreseen_cached_tokens, r.schedule_class[0])
            for r in ahead[:MAX_REPLAYED_AHEAD]
        ]
        config = self.scheduler_config
        limits = StepLimits(
            config.max_num_seqs, config.max_num_batched_tokens, config.long_prefill_token_threshold
        )
        seconds = replay_ttft(
            running, replayed, request.num_tokens - hit, limits, self.step_time, self._expected_arrivals(cls)
        )
        if seconds is not None and len(replayed) < len(ahead):
            seconds *= (len(ahead) + 1) / (len(replayed) + 1)
        waited = max(self.clock() - request.arrival_time, 0.0)
        tokens_ahead = sum(seq.prefill_left for seq in running) + sum(
            max(r.num_tokens - r.foreseen_cached_tokens, 1) for r in ahead
        )
        return TtftPrediction(
            seconds=None if seconds is None else waited + seconds,
            requests_ahead=len(ahead),
            tokens_ahead=tokens_ahead,
            running=len(self.running),
            cached_tokens=hit,
        )

    def _expected_arrivals(self, cls: tuple[int, int]) -> list[ArrivalStream]:
        """The better tiers' requests a request of admission class ``cls`` expects to be overtaken by: per
        tier better than its own with requests queued in :attr:`arrivals`' window, one every 1 / rate
        seconds with the window's mean prompt to compute and the output :attr:`output_lengths` expects of
        its mean ``max_tokens`` (rounded to whole tokens)."""
        now = self.clock()
        streams = []
        for tier in range(cls[0]):
            measured = self.arrivals.rate(tier, now)
            if measured is None:
                continue
            per_s, prompt_tokens, max_tokens = measured
            expected = self.output_lengths.expected(max(round(max_tokens), 1))
            streams.append(ArrivalStream(tier, 1.0 / per_s, max(round(prompt_tokens), 1), expected - 1))
        return streams

    def _kept_running(self, cls: tuple[int, int], num_ahead: int) -> list[Request]:
        """The running requests a new request of admission class ``cls`` with ``num_ahead`` requests ahead
        would wait for: all but the newest running requests of a deferrable tier worse than its own, as many
        as :meth:`_defer` would preempt for it and those ahead (one per missing free slot)."""
        need = num_ahead + 1 - (self.scheduler_config.max_num_seqs - len(self.running))
        if need <= 0:
            return self.running
        deferred: set[str] = set()
        for request in reversed(self.running):
            if len(deferred) == need:
                break
            if request.service_tier in DEFERRABLE_TIERS and request.schedule_class[0] > cls[0]:
                deferred.add(request.request_id)
        return [r for r in self.running if r.request_id not in deferred]

    def expire_waiting(self) -> list[Request]:
        """Drop the requests whose deadline passed (by :attr:`clock`) while they still wait for their first
        admission: finished FINISHED_ABORTED before any prefill. Returns them (the engine tells their
        clients); a request already admitted once is left to finish."""
        now = self.clock()
        expired: list[Request] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.WAITING or request.num_cached_tokens >= 0:
                continue
            self._finish(request, RequestStatus.FINISHED_ABORTED, now)
            expired.append(request)
        return expired

    def shed_overdue(self) -> list[Overdue]:
        """Drop the waiting requests, never admitted yet, of a tier with an objective
        (:attr:`ttft_objectives`) whose first token can no longer come within it: the time since their
        arrival plus the steps of their own prefill (the prompt the prefix cache does not hold, in chunks of
        the step's limits, each priced by :attr:`step_time` beside the running batch; nothing while it has
        no fit) exceeds the objective, and that prefill alone does not (such a request was admitted on an
        idle engine, where no wait could be avoided). Finished FINISHED_ABORTED before any prefill; returns
        them with their figures, in the order found (the engine answers them with admission's 503). A request
        admitted once (scheduled, even if preempted since) is left to finish, and so is every prompt and
        choice of a client request one of whose prompts or choices was (its first token, which the objective
        is about, has come or is on its way; the server may have sent its 200). Cost: O(log n) per request
        queued; a request is looked at when its estimated last moment comes (its own prefill estimated when it
        was queued, then again at each look); a sweep that drops any sorts the waiting requests once
        (O(n log n)) to count each one's requests ahead in the queue as it stood."""
        if not self._overdue_at:
            return []
        now = self.clock()
        overdue: list[tuple[Request, float]] = []
        kept: list[tuple[float, str]] = []
        while self._overdue_at and self._overdue_at[0][0] <= now:
            _, request_id = heapq.heappop(self._overdue_at)
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.WAITING:
                continue
            if self._shares.started(request.fairness_key):
                continue  # it, or another prompt or choice of its client request, was admitted: on time
            objective = self.ttft_objectives[request.service_tier]
            _, hit = self.kv_cache_manager.get_computed_blocks(request)
            own_s = self._first_steps_s(request.num_tokens - hit)
            if own_s >= objective:
                continue  # late even on an idle engine: admitted idle (no wait to avoid), so it runs
            due = request.arrival_time + objective
            if now + own_s <= due:
                kept.append((due - own_s, request_id))  # its prefill got cheaper: look again then
                continue
            overdue.append((request, own_s))
        for entry in kept:
            heapq.heappush(self._overdue_at, entry)
        if not overdue:
            return []
        order = sorted(  # the waiting requests in admission order, before any of this sweep's drops
            (r.schedule_class, self.waiting.position(r)) for _, group in self.waiting.groups() for r in group
        )
        dropped: list[Overdue] = []
        for request, own_s in overdue:
            ahead = bisect.bisect_left(order, (request.schedule_class, self.waiting.position(request)))
            waited = max(now - request.arrival_time, 0.0)
            self._finish(request, RequestStatus.FINISHED_ABORTED, now)
            dropped.append(Overdue(request, waited, waited + own_s, ahead))
        return dropped

    def _first_steps_s(self, prefill_tokens: int) -> float:
        """Seconds of the steps that compute ``prefill_tokens`` prompt tokens beside the running batch's
        decodes, in chunks of ``long_prefill_token_threshold`` (else ``max_num_batched_tokens``); 0 while
        :attr:`step_time` has no fit."""
        config = self.scheduler_config
        chunk = config.max_num_batched_tokens
        if config.long_prefill_token_threshold > 0:
            chunk = min(chunk, config.long_prefill_token_threshold)
        rows = len(self.running)
        context = sum(r.num_computed_tokens for r in self.running)
        left, seconds = max(prefill_tokens, 1), 0.0
        while left > 0:
            step = self.step_time.predict(min(left, chunk), rows, context)
            if step is None:
                return 0.0
            seconds += step
            left -= chunk
        return seconds

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish each known request with FINISHED_ABORTED; returns those that were still unfinished."""
        aborted = (self.finish_request(rid, RequestStatus.FINISHED_ABORTED) for rid in request_ids)
        return [request for request in aborted if request is not None]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request by id, else None."""
        return self.requests.get(request_id)

    # ---- one step ----------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step: the fairness preemptions, running requests, then waiting ones (skipped in a step
        that preempted for KV blocks).

        Advances each scheduled request's ``num_computed_tokens`` by its scheduled tokens (vLLM v1
        ``_update_after_schedule``): the runner must compute them before the next call.
        """
        plan = _StepPlan(token_budget=self.scheduler_config.max_num_batched_tokens)
        rebalanced_groups = self._rebalance(plan)
        self._schedule_running(plan)
        if not plan.preempted_req_ids:
            self._schedule_waiting(plan, rebalanced_groups)
        elif self.waiting:
            self._blocked_steps.count(QueueLimit.PREEMPTION)
        return self._build_output(plan)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[Request]:
        """Append each request's emitted tokens (``sampled``: request_id → token ids, one or, after a verified
        draft, the accepted draft tokens then the target's token) one by one, with the stop checks after each.

        Only requests scheduled with ``sample=True`` take tokens; requests finished meanwhile (aborted during
        the step) are skipped. Stop checks, in order: ``stop_token_ids`` (FINISHED_STOPPED, ``stop_reason`` =
        the id) and EOS unless ``ignore_eos`` (FINISHED_STOPPED), both only once ``num_output_tokens >=
        min_tokens``; then ``max_tokens`` and ``max_model_len`` (FINISHED_LENGTH). The tokens after the one
        that finished a request are dropped: ``sampled[request_id]`` is shortened in place. A request with
        drafts gets ``num_computed_tokens`` rolled back past its rejected draft positions (their KV is
        overwritten next step) and its blocks wholly past its tokens freed. Returns the requests finished by
        this step, in scheduling order; their blocks are freed.
        """
        now = self.clock()
        self._attribute_step(scheduler_output, now - scheduler_output.scheduled_time)
        self._observe_step(scheduler_output, now)
        finished: list[Request] = []
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            token_ids = sampled.get(request.request_id)
            if not token_ids or not scheduled.sample or request.is_finished:
                continue
            status = None
            if request.stats.first_token_time is None:
                self._observe_first_token(request, now)
            for kept, token_id in enumerate(token_ids, start=1):
                request.append_output_token_ids([token_id])
                request.stats.on_token(now)
                status = self._check_stop(request, token_id)
                if status is not None:
                    if kept < len(token_ids):
                        sampled[request.request_id] = token_ids[:kept]
                    break
            if scheduled.spec_token_ids:
                self._on_verified(scheduled, len(token_ids) - 1, keep_blocks=status is None)
            if status is not None:
                self._finish(request, status, now)
                finished.append(request)
        self._busy_since = now if self.has_unfinished_requests() else None
        return finished

    def _observe_first_token(self, request: Request, now: float) -> None:
        """Hand a request's predicted and actual TTFT to :attr:`ttft_calibration` (choice 0 only of an ``n >
        1`` request: its siblings share its prediction)."""
        predicted = request.stats.predicted_ttft_s
        parent = request.parent_id
        if predicted is None or (parent is not None and request.request_id != child_request_id(parent, 0, 2)):
            return
        self.ttft_calibration.observe(
            request.schedule_class[0], predicted, now - request.arrival_time, now=now
        )

    def _on_verified(self, scheduled: ScheduledRequest, num_accepted: int, keep_blocks: bool) -> None:
        """Tell the drafter and the stats; roll back past the rejected positions."""
        request, num_draft = scheduled.request, len(scheduled.spec_token_ids)
        if self.drafter is not None:
            self.drafter.on_verified(request, num_draft, num_accepted)
        request.stats.on_spec_verify(num_draft, num_accepted)
        request.num_computed_tokens -= num_draft - num_accepted
        if keep_blocks:
            self.kv_cache_manager.trim(request, request.num_tokens)

    def _observe_step(self, out: SchedulerOutput, now: float) -> None:
        """Feed the step's shape and seconds to the step-time model (the TTFT prediction's). The seconds are
        the step's period — from the previous step's output to this one's, when the engine stayed busy in
        between (the host work between steps included: delivering outputs, queueing arrivals), else from
        this step's scheduling."""
        start = out.scheduled_time
        if self._busy_since is not None:
            start = min(start, self._busy_since)
        if not out.scheduled:
            return
        context = sum(item.num_computed_tokens + item.num_scheduled_tokens for item in out.scheduled)
        self.step_time.observe(out.num_prefill_tokens, out.num_decode_tokens, context, now - start)

    def _attribute_step(self, out: SchedulerOutput, dt: float) -> None:
        """Add the step to each scheduled request's step records (engine/core/attribution.py): a few adds
        per scheduled request, its phase by whether its first token was sampled. The choices of one ``n >
        1`` request (``Request.parent_id``) count each other's tokens as their own."""
        prefill, decode, count = out.num_prefill_tokens, out.num_decode_tokens, len(out.scheduled)
        share = dt / max(prefill + decode, 1)
        groups: dict[str, _GroupTokens] = {}  # parent id -> its choices' tokens in this step
        for item in out.scheduled:
            if item.request.parent_id is not None:
                groups.setdefault(item.request.parent_id, _GroupTokens()).add(item)
        for item in out.scheduled:
            stats = item.request.stats
            attribution = stats.attribution
            phase = attribution.prefill if stats.first_token_time is None else attribution.decode
            group = groups.get(item.request.parent_id) if item.request.parent_id is not None else None
            if group is None:
                group = _GroupTokens()
                group.add(item)
            phase.add(
                group.prefill + group.decode,
                prefill - group.prefill,
                decode - group.decode,
                count - group.requests,
                dt,
                share,
            )

    def get_stats(self) -> SchedulerStats:
        """Snapshot of queue sizes, block states and the preemption / prefix-cache counters."""
        pool = self.kv_cache_manager.block_pool
        num_free = pool.get_num_free_blocks()
        num_cached = pool.get_num_cached_free_blocks()
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_used_blocks=pool.num_blocks - num_free,
            num_cached_blocks=num_cached,
            num_free_blocks=num_free - num_cached,
            num_preemptions_total=self._num_preemptions_total,
            prefix_cache_queries=self._prefix_cache_queries,
            prefix_cache_hits=self._prefix_cache_hits,
        )

    # ---- scheduling internals ----------------------------------------------------------------------------

    def _defer(self, plan: _StepPlan) -> set[str]:
        """Tiers: while the waiting requests of tiers better than a deferrable one (``flex``) outnumber the
        free running slots, preempt the newest running request of the worst deferrable tier below them.
        Returns the groups that lost one (they admit nobody this step)."""
        groups: set[str] = set()
        free = self.scheduler_config.max_num_seqs - len(self.running)
        running_ranks = {r.schedule_class[0] for r in self.running}
        for rank in sorted((TIER_RANK[tier] for tier in DEFERRABLE_TIERS), reverse=True):
            if rank not in running_ranks:
                continue
            better = sum(
                len(queue) for _, queue in self.waiting.groups() if queue[0].schedule_class[0] < rank
            )
            while better > free:
                victim = next((r for r in reversed(self.running) if r.schedule_class[0] == rank), None)
                if victim is None:
                    break
                self._evict(victim, plan, groups)
                free += 1
        return groups

    def _rebalance(self, plan: _StepPlan) -> set[str]:
        """Tiers first (:meth:`_defer`), then rule 2 of engine/core/fairness.py: while the waiting groups of
        the best tier waiting under their share claim more slots than are free, preempt the newest running
        request of that tier or a worse one of the tenant, then the group, furthest over its share. Returns
        the groups that lost one (they admit nobody this step)."""
        if not self.waiting:
            return set()
        groups = self._defer(plan)
        free = self.scheduler_config.max_num_seqs - len(self.running)
        if len(self.waiting) <= free:  # claims never exceed the waiting sequences: nobody to preempt for
            return groups
        best = min(queue[0].schedule_class[0] for _, queue in self.waiting.groups())
        demand, claimants = claims(self.waiting, self._shares, best)
        candidates = {r.request_id for r in self.running if r.schedule_class[0] >= best}
        while (
            demand > free
            and (victim := fairness_victim(self.running, self._shares, candidates, claimants=claimants))
            is not None
        ):
            candidates.discard(victim.request_id)
            self._evict(victim, plan, groups)
            free += 1
        return groups

    def _evict(self, victim: Request, plan: _StepPlan, groups: set[str]) -> None:
        """Preempt the running ``victim`` to free its slot for this step's rebalancing; its group is added to
        ``groups`` (the groups that admit nobody this step)."""
        self.running.remove(victim)
        self._preempt(victim)
        plan.rebalanced_req_ids.add(victim.request_id)
        groups.add(victim.fairness_key)

    def _schedule_running(self, plan: _StepPlan) -> None:
        drafts = self._propose_drafts()
        # running requests not visited yet: the KV victims come from these and the current one
        pending = {request.request_id for request in self.running}
        for request in round_robin(self.running):  # admission order when every tenant runs one request
            if plan.token_budget <= 0:
                break
            if request.request_id not in pending:
                continue  # preempted earlier in this step
            pending.discard(request.request_id)
            num_new = self._num_new_tokens(request, request.num_computed_tokens, plan.token_budget)
            if num_new > 0:
                room = plan.token_budget - num_new - len(pending)  # 1 left per later one
                draft = drafts.get(request.request_id, [])[: max(room, 0)]
                if draft and self.kv_cache_manager.allocate_slots(request, num_new + len(draft)) is not None:
                    plan.add(request, num_new, is_new=False, draft=draft)
                elif not self._allocate_or_preempt(request, num_new, plan, pending):
                    break  # drafts never preempt: without its blocks the request runs plain (or is preempted)
                else:
                    plan.add(request, num_new, is_new=False)

    def _propose_drafts(self) -> dict[str, list[int]]:
        """request_id → draft tokens for the running decode-phase requests (one new token to compute), capped
        so that the step cannot pass ``max_tokens`` or ``max_model_len``; {} when the drafter declines."""
        if self.drafter is None:
            return {}
        decode = [
            r for r in self.running if r.num_tokens - r.num_computed_tokens == 1 and r.num_output_tokens > 0
        ]
        drafts = []
        for request in decode:
            max_draft = (
                min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens)
                - 1
            )
            if max_draft > 0 and (draft := self.drafter.propose(request, max_draft)):
                drafts.append((request, draft))
        if not drafts or not self.drafter.allows(len(decode), drafts):
            return {}
        return {request.request_id: draft for request, draft in drafts}

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, plan: _StepPlan, pending: set[str]
    ) -> bool:
        """Allocate, preempting until it fits (rule 4 of engine/core/fairness.py: the newest
        not-yet-scheduled request, ``pending`` or ``request`` itself, of the tenant, then the group,
        furthest over its share, else the newest of them); False if ``request`` itself went."""
        while self.kv_cache_manager.allocate_slots(request, num_new_tokens) is None:
            candidates = pending | {request.request_id}
            victim = fairness_victim(self.running, self._shares, candidates) or next(
                r for r in reversed(self.running) if r.request_id in candidates
            )
            self.running.remove(victim)
            pending.discard(victim.request_id)
            self._preempt(victim)
            plan.preempted_req_ids.add(victim.request_id)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, plan: _StepPlan, excluded_groups: set[str]) -> None:
        """Admit waiting requests in rule 1's order (engine/core/fairness.py) until a limit stops the one
        whose turn it is: nobody overtakes it. ``excluded_groups`` (preempted for fairness this step) admit
        nobody."""
        max_num_seqs = self.scheduler_config.max_num_seqs
        order: AdmissionOrder | None = None  # built once a request can be admitted (a full engine skips it)
        while self.waiting:
            if plan.token_budget <= 0 or len(self.running) >= max_num_seqs:
                limit = QueueLimit.MAX_NUM_SEQS if plan.token_budget > 0 else QueueLimit.TOKEN_BUDGET
                self._blocked_steps.count(limit)
                break
            if order is None:
                order = AdmissionOrder(self.waiting, self._shares, excluded_groups)
            request = order.peek()
            if request is None:  # only groups that gave up a slot this step are left
                self._blocked_steps.count(QueueLimit.MAX_NUM_SEQS)
                break
            hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new = self._num_new_tokens(request, num_hit_tokens, plan.token_budget)
            if num_new <= 0 or self.kv_cache_manager.allocate_slots(request, num_new, hit_blocks) is None:
                self._blocked_steps.count(QueueLimit.TOKEN_BUDGET if num_new <= 0 else QueueLimit.KV_CACHE)
                break  # nobody overtakes the request whose turn it is
            self.waiting.remove(request)
            self._admit(request, num_hit_tokens)
            order.admitted(request)
            plan.add(request, num_new, is_new=True)

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        num_new = request.num_tokens - num_computed_tokens
        threshold = self.scheduler_config.long_prefill_token_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        return min(num_new, token_budget, self.max_model_len - num_computed_tokens)

    def _admit(self, request: Request, num_hit_tokens: int) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        self.running.append(request)
        self._shares.admitted(request)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
            request.stats.num_cached_tokens = num_hit_tokens
            request.stats.attribution.on_first_admission(self._blocked_steps)
            if self.kv_cache_manager.reads_prefix_cache(request):  # vLLM counts only the lookups it made
                self._prefix_cache_queries += request.num_tokens
                self._prefix_cache_hits += num_hit_tokens

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute a request the caller took out of ``running``: blocks freed, front of the
        queue."""
        self._shares.stopped_running(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.stats.attribution.recomputed_tokens += request.num_computed_tokens
        request.num_computed_tokens = 0
        request.stats.num_preemptions += 1
        self._num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _build_output(self, plan: _StepPlan) -> SchedulerOutput:
        now = self.clock()
        scheduled = [
            self._scheduled_request(req, num_new, is_new, draft)
            for req, num_new, is_new, draft in plan.entries
        ]
        for item in scheduled:
            item.request.num_computed_tokens += item.num_scheduled_tokens
            item.request.stats.on_scheduled(now, batch_size=len(scheduled), num_blocks=len(item.block_ids))
            if item.is_new:
                item.request.stats.attribution.on_readmitted(now, item.request.stats.first_token_time is None)
        preempted = plan.preempted_req_ids | plan.rebalanced_req_ids
        for request_id in preempted:
            self.requests[request_id].stats.attribution.preempted_at = now
        total = sum(item.num_scheduled_tokens for item in scheduled)
        num_decode = sum(item.num_scheduled_tokens for item in scheduled if _is_decode(item))
        finished_req_ids, self._finished_req_ids = self._finished_req_ids, set()
        return SchedulerOutput(
            scheduled=scheduled,
            total_num_scheduled_tokens=total,
            preempted_req_ids=preempted,
            finished_req_ids=finished_req_ids,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_prefill_tokens=total - num_decode,
            num_decode_tokens=num_decode,
            scheduled_time=now,
        )

    def _scheduled_request(
        self, request: Request, num_new_tokens: int, is_new: bool, draft: list[int]
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request=request,
            token_ids=request.all_token_ids[start : start + num_new_tokens] + draft,
            num_computed_tokens=start,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            sample=start + num_new_tokens == request.num_tokens,
            is_new=is_new,
            spec_token_ids=draft,
        )

    # ---- finishing ---------------------------------------------------------------------------------------

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_id_set:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if (
                not params.ignore_eos
                and request.eos_token_id is not None
                and token_id == request.eos_token_id
            ):
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus, now: float) -> None:
        """Take the request out of its queue, record its finish stats, free its blocks."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._shares.stopped_running(request)
        else:
            self.waiting.remove(request)
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.output_lengths.observe(request.num_output_tokens, status == RequestStatus.FINISHED_LENGTH)
        self._shares.finished(request)
        request.status = status
        request.stats.kv_cache_usage = self.kv_cache_manager.usage
        request.stats.finished_time = now
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.add(request.request_id)
        if self.drafter is not None:
            self.drafter.drop(request.request_id)


@dataclass(frozen=True, slots=True)
class Overdue:
    """A request :meth:`Scheduler.shed_overdue` dropped from the queue."""

    request: Request
    waited_s: float
    """Arrival → the drop."""
    predicted_ttft_s: float
    """``waited_s`` plus its own prefill's steps: the earliest first token it could still have had."""
    requests_ahead: int
    """Waiting requests that would have been admitted before it."""


@dataclass(slots=True)
class _GroupTokens:
    """One request's tokens in a step, summed over its ``n > 1`` choices (``Request.parent_id``)."""

    prefill: int = 0
    decode: int = 0
    requests: int = 0

    def add(self, item: ScheduledRequest) -> None:
        if _is_decode(item):
            self.decode += len(item.token_ids)
        else:
            self.prefill += len(item.token_ids)
        self.requests += 1


def _is_decode(item: ScheduledRequest) -> bool:
    """A decode feeds back exactly one generated token (plus its draft tokens, if any); everything else
    (prompt chunks, recomputation of generated tokens after preemption) counts as prefill."""
    return (
        item.num_scheduled_tokens - len(item.spec_token_ids) == 1
        and item.num_computed_tokens >= item.request.num_prompt_tokens
    )
