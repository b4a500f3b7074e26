#!/usr/bin/env python3
"""Crash loop: SIGKILL the daemon again and again while 8 sessions stream, and
check that no committed event a client was handed is ever lost or altered.

    python3 crash_loop.py --kills 50          # about 1.5 minutes on two cores
    python3 crash_loop.py --kills 1000        # the long run

Each of the 8 client threads repeatedly generates a few tokens on its session
(/web/stream) and appends a user message (/web/rpc), recording every committed
event it receives: the stream's ``committed`` lines and the ``Committed``
replies. Connection errors are expected (the daemon dies under them); the
thread waits and carries on once the daemon is back. The main thread kills the
daemon at a random moment, restarts it on the same sessions dir and port, and
checks that every event recorded so far is in the restarted daemon's ``Read``
of its session: at its id, identical (epoch and timestamp included), with the
ids running 0, 1, 2... in order. Every few rounds a thread moves to a fresh
session so contexts stay small; the old ones are still checked.
"""

import argparse
import os
import random
import sys
import threading
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from superfluid_client import Event, Sampling, SuperfluidError  # noqa: E402
from superfluid_client.daemon import Daemon  # noqa: E402

SESSIONS = 8
ROUNDS_PER_SESSION = 12


class Recorder:
    """Every committed event any client received, per session, by id."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: Dict[int, Dict[int, dict]] = {}
        self.conflicts: List[str] = []

    def add(self, session: int, event: Event) -> None:
        with self.lock:
            seen = self.events.setdefault(session, {})
            old = seen.get(event.id)
            if old is not None and old != event.raw:
                self.conflicts.append("session {} event {} handed out twice, differently:\n  {}\n  {}".format(
                    session, event.id, old, event.raw))
            seen[event.id] = event.raw

    def snapshot(self) -> Dict[int, Dict[int, dict]]:
        with self.lock:
            return {s: dict(evs) for s, evs in self.events.items()}


class Worker(threading.Thread):
    """One client: generate a little, append a user message, again and again."""

    def __init__(self, n: int, daemon: Daemon, recorder: Recorder, stop: threading.Event, seed: int):
        super().__init__(daemon=True, name="client-{}".format(n))
        self.n, self.d, self.rec, self.stop_flag = n, daemon, recorder, stop
        self.rng = random.Random(seed)
        self.session = None
        self.rounds = 0
        self.generations = 0
        # Events a stream reported committed (and the recorder checks).
        self.stream_events = 0
        self.errors = 0
        self.failure: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            self.failure = e

    def _retrying(self, what):
        """Runs ``what`` until it succeeds or the run stops; connection errors
        and refusals while the daemon restarts (or a session is busy finishing
        a generation whose stream died) are waited out."""
        while not self.stop_flag.is_set():
            try:
                return what()
            except (SuperfluidError, OSError) as e:
                self.errors += 1
                if os.environ.get("CRASH_LOOP_DEBUG"):
                    print(self.name, "retry:", str(e)[:120], flush=True)
                if "unknown session" in str(e):
                    raise
                time.sleep(0.05 + self.rng.random() * 0.1)
        return None

    def _loop(self) -> None:
        sf = self.d.client(timeout=30)
        while not self.stop_flag.is_set():
            if self.session is None or self.rounds >= ROUNDS_PER_SESSION:
                self.session = self._retrying(lambda: sf.session(Sampling(temperature=0.8, seed=self.n)))
                if self.session is None:
                    return
                self.rounds = 0
                ev = self._retrying(lambda: self.session.user("Tell me about rivers, part {}.".format(self.n)))
                if ev is not None:
                    self.rec.add(self.session.id, ev)
            s = self.session
            stream = s.stream(max_tokens=self.rng.randint(4, 16))
            try:
                for _ in stream:
                    if self.stop_flag.is_set():
                        break
                self.generations += 1
            except (SuperfluidError, OSError) as e:
                self.errors += 1
                if os.environ.get("CRASH_LOOP_DEBUG"):
                    print(self.name, "stream:", str(e)[:120], flush=True)
                time.sleep(0.05)
            finally:
                for e in stream.committed:
                    self.rec.add(s.id, e)
                    self.stream_events += 1
                stream.close()
            ev = self._retrying(lambda: s.user("Go on ({}).".format(self.rounds)))
            if ev is not None:
                self.rec.add(s.id, ev)
            self.rounds += 1


def check(d: Daemon, recorder: Recorder) -> (int, List[str]):
    """Reads every recorded session back; returns (events checked, problems)."""
    snap = recorder.snapshot()  # taken before the reads: all of it was committed before them
    sf = d.client(timeout=30)
    checked, problems = 0, []
    for session, events in snap.items():
        log = [e.raw for e in sf.get(session).events()]
        ids = [e["event_id"] for e in log]
        if ids != list(range(len(log))):
            problems.append("session {}: ids out of order: {}".format(session, ids))
        for eid, raw in sorted(events.items()):
            checked += 1
            if eid >= len(log):
                problems.append("session {}: event {} lost (log has {} events): {}".format(session, eid, len(log), raw))
            elif log[eid] != raw:
                problems.append("session {}: event {} altered:\n  received {}\n  read     {}".format(
                    session, eid, raw, log[eid]))
    return checked, problems


def run(kills: int = 50, seed: Optional[int] = None, min_delay: float = 0.3, max_delay: float = 2.0,
        verbose: bool = False, binary: Optional[str] = None, model: Optional[str] = None) -> dict:
    """Runs the loop; returns the counts (kills, checked, lost_or_altered, problems...)."""
    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    recorder = Recorder()
    stop = threading.Event()
    started = time.time()
    checked_total, problems = 0, []
    with Daemon(binary=binary, model=model) as d:
        workers = [Worker(i, d, recorder, stop, rng.randrange(1 << 30)) for i in range(SESSIONS)]
        for w in workers:
            w.start()
        try:
            for k in range(1, kills + 1):
                time.sleep(rng.uniform(min_delay, max_delay))
                d.kill9()
                time.sleep(rng.uniform(0.0, 0.2))
                d.start()
                checked, found = check(d, recorder)
                checked_total += checked
                problems += found
                if verbose:
                    print("kill {}: {} events checked, {} problems".format(k, checked, len(found)), flush=True)
                if found:
                    break
        finally:
            stop.set()
            for w in workers:
                w.join(60)
    failures = ["{}: {!r}".format(w.name, w.failure) for w in workers if w.failure]
    distinct = sum(len(v) for v in recorder.snapshot().values())
    return {
        "kills": k,
        "seed": seed,
        "checked": checked_total,
        "distinct_events": distinct,
        "sessions": len(recorder.events),
        "generations": sum(w.generations for w in workers),
        "stream_events": sum(w.stream_events for w in workers),
        "client_errors": sum(w.errors for w in workers),
        "lost_or_altered": len(problems),
        "problems": problems + recorder.conflicts,
        "worker_failures": failures,
        "seconds": time.time() - started,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description="SIGKILL the daemon while 8 sessions stream; check every committed event.")
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--min-delay", type=float, default=0.3, help="seconds of running before a kill, at least")
    ap.add_argument("--max-delay", type=float, default=2.0, help="seconds of running before a kill, at most")
    ap.add_argument("--bin", default=None, help="the superfluid binary (default: SUPERFLUID_BIN, ...)")
    ap.add_argument("--model", default=None)
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    r = run(a.kills, a.seed, a.min_delay, a.max_delay, a.verbose, a.bin, a.model)
    for p in r["problems"][:20]:
        print(p)
    for f in r["worker_failures"]:
        print("client failed:", f)
    print("seed {seed}, {sessions} sessions, {generations} generations, {client_errors} client errors "
          "(expected: the daemon dies under them), {seconds:.0f}s".format(**r))
    print("kills: {kills}, events checked: {checked} ({distinct_events} distinct), lost or altered: {lost_or_altered}"
          .format(**r))
    return 0 if not r["problems"] and not r["worker_failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
