"""The ingress's worker without a cluster: the shared worker role, the release thread, the call context.

A recording stand-in for the replica deployment's handle answers the calls :class:`ReplicaSetWorker`
makes (``stats``, ``release``, a streaming ``generate``), so what the worker sends, from which thread and
in which Serve request context, is asserted exactly.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from types import SimpleNamespace

from ray.serve import context as serve_context

from pagedgen.engine.events import EngineErrorCode, FinishReason
from pagedgen.llm import SamplingParams
from pagedgen.models.synthetic import SyntheticModel
from pagedgen.server.replicas import registry
from pagedgen.server.replicas.client import ReplicaSetWorker
from pagedgen.server.replicas.messages import ReplicaJob, ReplicaStats, ReplicaTarget
from pagedgen.server.worker import EngineSnapshot, EngineWorker, Finish, JobUpdate
from pagedgen.server.worker_protocol import ServingWorker

APP, DEPLOYMENT = "test-app", "TestReplica"
FINISH = Finish(FinishReason.MAX_GENERATED_TOKENS, 3, 1, 0, None, EngineErrorCode.NONE)


class _Result:
    def __init__(self, value):
        self._value = value

    def result(self, timeout_s=None):
        return self._value


class _Stream:
    """A streaming call's response: the updates the replica would send, then the end."""

    def __init__(self, updates):
        self._updates = list(updates)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._updates:
            raise StopAsyncIteration
        return self._updates.pop(0)

    def cancel(self):
        self.cancelled = True


class _Handle:
    """Records every call: (method, arguments, thread name, the Serve internal request id it would use)."""

    def __init__(self):
        self.calls = []
        self._stream = False

    def options(self, *, stream=False):
        copy = _Handle.__new__(_Handle)
        copy.calls, copy._stream = self.calls, stream
        return copy

    def __getattr__(self, method):
        def remote(*args):
            request_id = serve_context._get_serve_request_context()._internal_request_id
            self.calls.append((method, args, threading.current_thread().name, request_id))
            if method == "stats":
                return _Result(ReplicaStats("r1", EngineSnapshot(total_blocks=4, free_blocks=4), b"", True))
            if method == "generate":
                return _Stream([JobUpdate(started=True, tokens=[7]), JobUpdate(finish=FINISH)])
            return _Result(None)

        return SimpleNamespace(remote=remote)


def _worker(handle: _Handle) -> ReplicaSetWorker:
    replicas = [SimpleNamespace(unique_id=name) for name in ("r1", "r2")]
    registry.register(APP, DEPLOYMENT, SimpleNamespace(curr_replicas=replicas))
    return ReplicaSetWorker(handle, SyntheticModel(), APP, DEPLOYMENT, max_batch_size=8)


def _members(cls) -> dict[str, object]:
    return {
        name: inspect.signature(member) if callable(member) else "property"
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_")
    }


def test_both_workers_fill_the_serving_worker_role_with_its_signatures():
    role = {name for name in ServingWorker.__dict__ if not name.startswith("_")}
    assert role == {
        "model", "max_batch_size", "snapshot", "healthy", "error", "start", "shutdown", "abort", "submit",
        "release", "cancel", "sync",
    }  # fmt: skip
    expected = _members(ServingWorker)
    for cls in (EngineWorker, ReplicaSetWorker):
        found = _members(cls)
        for name in role:
            assert found.get(name) == expected[name], (cls.__name__, name)


def test_releases_go_to_every_live_replica_from_one_thread_in_order():
    handle = _Handle()
    worker = _worker(handle)
    worker.start()
    threads_before = threading.active_count()
    for index in range(20):
        worker.release(f"resp_{index}")
    worker.shutdown()  # drains the queue first: the stop marker is behind every key
    assert threading.active_count() == threads_before - 2  # the poll and release threads ended
    releases = [call for call in handle.calls if call[0] == "release"]
    assert [(args[0].replica, args[1]) for _m, args, _t, _r in releases] == [
        (replica, f"resp_{index}") for index in range(20) for replica in ("r1", "r2")
    ]
    assert {thread for _m, _a, thread, _r in releases} == {"pagedgen-replica-release"}


def test_every_job_calls_the_replicas_outside_the_http_request_s_serve_context():
    """Serve pairs a routed replica with its waiting call by the internal request id: two jobs of one HTTP
    request must not carry that request's id. Serve reads it from its request context variable, and an
    HTTP request sets it there; a job's call must see none (so Serve draws a fresh one)."""
    handle = _Handle()
    worker = _worker(handle)
    updates = []

    async def serve_one_request() -> None:
        serve_context._set_request_context(_internal_request_id="the-http-request")
        assert serve_context._get_serve_request_context()._internal_request_id == "the-http-request"
        done = asyncio.Event()

        def sink(update: JobUpdate) -> None:
            updates.append(update)
            if update.final and len([u for u in updates if u.final]) == 2:
                done.set()

        for _ in range(2):
            worker.submit([1, 2, 3], SamplingParams(max_tokens=1), sink, 0.0, tag="req-1")
        await done.wait()

    asyncio.run(serve_one_request())
    generates = [call for call in handle.calls if call[0] == "generate"]
    assert len(generates) == 2 and all(request_id == "" for *_rest, request_id in generates)
    assert all(isinstance(args[0], ReplicaJob) and args[0].tag == "req-1" for _m, args, _t, _r in generates)
    assert [u.tokens for u in updates if not u.final] == [[7], [7]]


def test_stats_calls_name_their_replica():
    handle = _Handle()
    worker = _worker(handle)
    worker.poll()
    assert [args for method, args, _t, _r in handle.calls if method == "stats"] == [
        (ReplicaTarget("r1"),),
        (ReplicaTarget("r2"),),
    ]
    assert set(worker.replica_stats) == {"r1"}  # both answered as r1: one entry by the replica's own name
