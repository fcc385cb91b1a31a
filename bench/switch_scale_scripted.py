"""Scripted nodes for bench/bench_switch_scale.py `--real-ranks K`: the job's other nodes, whose
relays answer as a relay whose ranks plan instantly would, so that thousands of ranks cost this
machine little and the K real `Participant`s (the job's last ranks) meet the coordinator's real
load at full N.

A scripted node is one relayed node (a TP group of `--ranks-per-node` ranks). Its relay, scripted:
pops its node's Prepare from rank 0's store (`node_down_queue`), sends up one Bundle of its ranks'
YES votes (summarized, as `NodeRelay` sends them: one `VoteSummary` per node) with the step this
process's trainer has reached and the hold step that step's pace and the Prepare's lead give
(`timing.hold_step`, as every rank computes its own); pops the decision; on a COMMIT its ranks
publish at the commit step's boundary and it sends up their acks as one Bundle. An ABORT is not
acked. The trainer thread steps in lockstep with the real ranks' processes (the same barrier), so
the votes' steps are the job's. Left out: the scripted ranks' planning and reading (instant), the
relay's checks of each rank's seal, and `Alive` beats (they vote at once).
"""

from __future__ import annotations

import collections
import gc
import threading
import time
from typing import Any

from dist_quant.coordinator.node_relay import summarized
from dist_quant.coordinator.protocol import Ack, Bundle, Decision, Hello, Prepare, Vote
from dist_quant.coordinator.timing import hold_step, pace
from dist_quant.coordinator.wire import INBOX, node_down_queue, seal, unseal
from switch_scale_ranks import GC_STEPS, RECIPE_A, BoundaryStalls

POPPERS = 4  # threads popping the scripted nodes' down queues, each on its own connection


class ScriptedNodes:
    """The relays of `nodes` (each a tuple of ranks, its lowest the leader), scripted."""

    def __init__(
        self, nodes: list[tuple[int, ...]], connect: Any, token: str, step_s: float, barrier: Any
    ) -> None:
        self.nodes = nodes
        self.ranks = sum(len(n) for n in nodes)
        self.failures: list[str] = []
        self.step = 0
        self.started = threading.Event()
        self.stall = BoundaryStalls()  # scripted ranks never wait: their boundaries are not timed
        self._token, self._step_s, self._barrier = token, step_s, barrier
        self._connect = connect
        self._intervals: collections.deque[float] = collections.deque(maxlen=64)
        self._lock = threading.Lock()
        self._due: list[tuple[int, int, str, tuple[int, ...]]] = []  # (step, switch, key, node)
        self._published: dict[str, int] = {}  # recipe key -> scripted ranks that published it
        self._last_publish = 0.0
        self._stop = threading.Event()
        t0 = time.monotonic()
        self._up = connect()
        self._up.push_many([(INBOX, self._sealed(n, [Hello(r, RECIPE_A["name"]) for r in n]))
                            for n in nodes])  # fmt: skip
        self._poppers = [
            threading.Thread(
                target=self._pop,
                args=(nodes[i::POPPERS],),
                daemon=True,
                name=f"bench.scripted.pop{i}",
            )  # fmt: skip
            for i in range(min(POPPERS, len(nodes)))
        ]
        for t in self._poppers:
            t.start()
        self.connect_s = time.monotonic() - t0
        self._trainer = threading.Thread(target=self._train, name="bench.trainer", daemon=True)
        self._trainer.start()

    def _sealed(self, node: tuple[int, ...], messages: list[Any]) -> bytes:
        return seal(Bundle.of(node[0], summarized(node[0], node, messages)), self._token)

    def _pop(self, nodes: list[tuple[int, ...]]) -> None:
        """Every switch sends each node a Prepare, then a decision: popped node by node."""
        link = self._connect()
        prepares: dict[int, Prepare] = {}
        try:
            while not self._stop.is_set():
                for node in nodes:
                    (data,) = link.pop_many(node_down_queue(node[0]), 1)
                    msg = unseal(data, self._token)
                    if isinstance(msg, Prepare):
                        prepares[msg.switch_id] = msg
                        link.push(INBOX, self._votes(node, msg))
                    elif isinstance(msg, Decision) and msg.commit:
                        key = prepares[msg.switch_id].recipe["name"]
                        with self._lock:
                            self._due.append((msg.step, msg.switch_id, key, node))
        except Exception as e:  # noqa: BLE001 - the bench reports it with the attach failures
            if not self._stop.is_set():
                self.failures.append(f"scripted relays: {type(e).__name__}: {e}")
        finally:
            link.close()

    def _votes(self, node: tuple[int, ...], p: Prepare) -> bytes:
        with self._lock:
            last, step_s = self.step - 1, pace(self._intervals)
        hold = hold_step(last, step_s, p.lead_s, p.at_step)
        digest = p.recipe["name"]
        return self._sealed(node, [Vote(p.switch_id, r, True, digest, last, "", 0.0, hold)
                                   for r in node])  # fmt: skip

    def _train(self) -> None:
        """A boundary per step: every node whose commit step this is publishes and acks."""
        began = None
        while not self._stop.is_set():
            with self._lock:
                now, step = time.monotonic(), self.step
                if began is not None:  # one step: boundary to boundary, the sleep and barrier in
                    self._intervals.append(now - began)
                began = now
                due = [d for d in self._due if d[0] <= step]
                self._due = [d for d in self._due if d[0] > step]
                for _, _, key, node in due:
                    self._published[key] = self._published.get(key, 0) + len(node)
                    self._last_publish = now
            if due:
                self._up.push_many([(INBOX, self._sealed(node, [Ack(sid, r, s, True, "", key)
                                                                for r in node]))
                                    for s, sid, key, node in due])  # fmt: skip
            self.started.set()
            with self._lock:
                self.step += 1
            if self.step % GC_STEPS == 0:
                gc.collect(1)
            self._stop.wait(self._step_s)
            if self._barrier is not None:
                try:
                    self._barrier.wait()
                except threading.BrokenBarrierError:
                    return

    def published(self, key: str) -> int:
        with self._lock:
            return self._published.get(key, 0)

    def last_publish(self) -> float:
        return self._last_publish

    def stop(self) -> None:
        self._stop.set()
        if self._barrier is not None:
            self._barrier.abort()
        self._trainer.join(10)


def scripted_worker(
    nodes: list[tuple[int, ...]], endpoint: dict, step_s: float, barrier: Any, conn: Any
) -> None:
    """The scripted nodes' process, driven by `conn` as `switch_scale_ranks.worker` is (the
    same commands; none of its ranks can be stopped, none holds a switch, none waits)."""
    from dist_quant.coordinator.job_host import connect_endpoint

    gc.disable()
    scripted = ScriptedNodes(nodes, lambda: connect_endpoint(endpoint), endpoint["token"],
                             step_s, barrier)  # fmt: skip
    scripted.started.wait(60)
    conn.send({"failures": scripted.failures, "connect_s": scripted.connect_s})
    cpu0 = time.process_time()
    while True:
        cmd = conn.recv()
        if cmd in ("measure", "step"):
            if cmd == "measure":
                cpu0 = time.process_time()
            conn.send(scripted.step)
        elif cmd == "holding":
            conn.send(0)
        elif isinstance(cmd, tuple):  # ("published", recipe name)
            conn.send({"published": scripted.published(cmd[1]),
                       "last_publish": scripted.last_publish()})  # fmt: skip
        elif cmd == "report":
            cpu = time.process_time() - cpu0
            conn.send({"last_publish": scripted.last_publish(), "max_stall_s": 0.0,
                       "max_step_s": 0.0, "stall": scripted.stall.report(),
                       "step": scripted.step, "cpu_s": cpu,
                       "cpu_by_thread_s": {"scripted": cpu}})  # fmt: skip
        else:
            scripted.stop()
            conn.send("bye")
            return
