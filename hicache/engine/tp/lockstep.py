"""One plan per step for every tensor-parallel rank: what the leader decided, sent once, followed by all.

Rank 0 (the leader) runs the scheduler, the radix tree and the controller. Its controller's byte moves (copies
between GPU and host, L3 reads, writes and deletes) are made on its own tiers and recorded as ops
(hicache.engine.tp.ports); page ids and keys are the leader's decisions, and every rank's pools have the same
capacities, so they mean the same on every rank. Each exchange is, on every rank and in this order:

1. `broadcast_plan`: the leader's `Plan` (the ops recorded since the last one, and the step's forward inputs or
   none) reaches every rank, which applies the ops to its own tiers and waits for its copies;
2. the forward, when the plan has one: the same batch on every rank, whose all-reduces and gathers run whatever
   the batch holds;
3. `gather_reports`: each rank's `Report` (the L3 reads and writes it finished since, with their per-page
   results, and any error) reaches the leader.

So the sequence of collectives depends only on whether a plan carries a forward, which every rank learns from the
same broadcast: no rank takes a branch of its own that adds or skips one. The leader holds back the completion of
an L3 read or write from its controller until every rank has reported it, and ANDs the per-page results, so a read
that failed on one rank fails for all and the controller's failed-load path recomputes the pages everywhere.

Every collective takes the process group's timeout; the leader also checks that its followers are alive before
each exchange. A lost rank ends the leader's engine with `RankLost` (a named error, `EngineHalted`), and a lost
leader ends the followers' collectives with an error. When the engine idles the leader still sends an empty plan
every `heartbeat_s`, so that no follower waits in a collective for as long as the timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hicache.engine.engine import EngineHalted, ForwardInputs

logger = logging.getLogger(__name__)

STEP, STOP = "step", "stop"
# how soon an idle leader exchanges again while I/O waits for the followers' reports (it needs an exchange to
# hear of them) and when nothing waits (a heartbeat)
REPORT_POLL_S = 0.002
HEARTBEAT_S = 1.0


class RankLost(EngineHalted):
    """A tensor-parallel rank is gone (exited, timed out, or failed to apply a plan): the group cannot go on."""


@dataclass
class Plan:
    """What every rank does in one exchange (see the module doc). `scratch`: a forward outside serving that every
    rank runs at once, by name (`SCRATCH_FORWARDS` in hicache.engine.tp.follower): prefill calibration, kernel
    warm-up."""

    kind: str
    seq: int
    ops: list[tuple] = field(default_factory=list)
    inputs: ForwardInputs | None = None
    scratch: tuple | None = None


@dataclass
class Report:
    """A rank's answer to a plan: (op id, per-page results) of each L3 read or write it finished since its last
    report, and an error that keeps it from going on (None: it follows)."""

    rank: int
    done: list[tuple[int, list[bool]]] = field(default_factory=list)
    error: str | None = None


class Collectives:
    """The two collectives of an exchange, on the default process group (whose timeout bounds each)."""

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size = rank, size
        # NCCL moves objects through tensors on the rank's GPU; gloo through the CPU
        self.object_device = device if device.type == "cuda" else None

    def broadcast_plan(self, plan: Plan | None) -> Plan:
        """The leader's plan (the leader passes it, the others None)."""
        box = [plan]
        dist.broadcast_object_list(box, src=0, device=self.object_device)
        return box[0]

    def gather_reports(self, report: Report) -> list[Report]:
        """Every rank's report, by rank."""
        return self.gather(report)

    def gather(self, item: Any) -> list[Any]:
        """Every rank's `item`, by rank (also the handshake when the group starts)."""
        items: list[Any] = [None] * self.size
        dist.all_gather_object(items, item)
        return items


class Lockstep:
    """The leader's side of the plan exchange: records ops, sends one plan per exchange, hands the followers'
    reports to the L3 proxy (`reports_to`), and notices lost ranks (`ranks.check_alive`)."""

    def __init__(self, collectives: Collectives, ranks: Any, timeout_s: float,
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        self.collectives = collectives
        self.timeout_s = timeout_s  # the process group's, on every collective
        self.ranks = ranks  # the follower processes: check_alive() raises RankLost, describe_loss() says which
        self.heartbeat_s = heartbeat_s
        self.ops: list[tuple] = []
        self.seq = 0
        self.broken: str | None = None  # why the group cannot go on, once it cannot
        self.exchanges = 0
        self.ops_sent = 0
        self._last = time.monotonic()
        self._on_reports: Callable[[int, list[tuple[int, list[bool]]]], None] | None = None
        self._awaiting: Callable[[], bool] = lambda: False

    def reports_to(self, receive: Callable[[int, list[tuple[int, list[bool]]]], None],
                   awaiting: Callable[[], bool]) -> None:
        """Where the followers' finished I/O goes, and whether any I/O waits for their reports."""
        self._on_reports, self._awaiting = receive, awaiting

    def record(self, op: tuple) -> None:
        """A byte move the leader made: every follower makes it in the next plan, in this order."""
        self.ops.append(op)

    def due(self) -> bool:
        """Whether an engine step without a forward should exchange anyway: ops wait to be sent, I/O waits for
        reports, or the heartbeat is due."""
        since = time.monotonic() - self._last
        if self.ops:
            return True
        return since >= (REPORT_POLL_S if self._awaiting() else self.heartbeat_s)

    def exchange(self, inputs: ForwardInputs | None = None, forward: Callable[[], Any] | None = None,
                 scratch: tuple | None = None) -> Any:
        """Send one plan (the pending ops, and `inputs` when the step has a forward), run `forward` (the leader's
        share of that forward, or of the `scratch` one), gather the reports; returns what `forward` returned.
        Raises RankLost if any rank is gone, or EngineHalted if the leader's own forward failed."""
        if self.broken is not None:
            raise RankLost(self.broken)
        try:
            self.ranks.check_alive()
        except RankLost as e:
            raise self.halt(str(e)) from None
        self.seq += 1
        plan = Plan(STEP, self.seq, self.ops, inputs, scratch)
        self.ops_sent += len(self.ops)
        self.ops = []
        try:
            self.collectives.broadcast_plan(plan)
        except Exception as e:  # noqa: BLE001 - a collective that fails: a rank died or timed out
            raise self._lost("sending a plan", e) from e
        result = None
        if forward is not None:
            try:
                result = forward()
            except Exception as e:  # noqa: BLE001 - the ranks' collectives are out of step now
                lost = self.ranks.describe_loss()  # a follower that died in the forward fails its all-reduces
                if lost is not None:
                    raise self.halt(f"{lost} (the forward's collectives failed: {e})") from e
                raise self.halt(f"the forward failed on rank 0 ({e!r}); the ranks' collectives are out of step",
                                 EngineHalted) from e
        try:
            reports = self.collectives.gather_reports(Report(0))
        except Exception as e:  # noqa: BLE001
            raise self._lost("gathering the ranks' reports", e) from e
        self._last = time.monotonic()
        self.exchanges += 1
        for report in reports[1:]:
            if report.error is not None:
                raise self.halt(f"tensor-parallel rank {report.rank} cannot follow the plan: {report.error}")
            if report.done and self._on_reports is not None:
                self._on_reports(report.rank, report.done)
        return result

    def stop(self) -> None:
        """Tell the followers to close their tiers and exit (the last plan); no-op once the group is broken."""
        if self.broken is not None:
            return
        self.broken = "the engine has stopped"
        self.seq += 1
        try:
            self.collectives.broadcast_plan(Plan(STOP, self.seq, self.ops))
        except Exception:  # noqa: BLE001 - a follower already gone: it has nothing left to close
            logger.exception("sending the stop plan failed")

    def _lost(self, doing: str, error: Exception) -> RankLost:
        who = self.ranks.describe_loss()
        if who is None:  # every follower process still runs: one is stuck, or its connection broke
            text = str(error).lower()
            who = (f"a tensor-parallel rank did not answer within {self.timeout_s:g} s (model.tp_timeout_s)"
                   if "timed out" in text or "timeout" in text else "a tensor-parallel rank's connection broke")
        return self.halt(f"{who} ({doing} failed: {error})")

    def halt(self, why: str, kind: type[EngineHalted] = RankLost) -> EngineHalted:
        """Mark the group broken (logged) and return the error to raise: nothing is sent to it any more."""
        self.broken = why
        logger.error("tensor-parallel group halted: %s", why)
        return kind(why)
