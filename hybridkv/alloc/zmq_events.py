"""Publish KV event batches over ZMQ and rebuild a cache index from them.

The wire format is vLLM's ``ZmqEventPublisher``: a PUB socket sends three frames per batch,
``(topic, sequence number as 8 big-endian bytes, msgpack batch)``, so vLLM's example subscriber
reads our stream. PUB/SUB drops messages while a subscriber is still connecting, and the
sequence numbers let it notice: :attr:`EventSubscriber.missed` counts the gaps. (vLLM's replay
socket, which resends missed batches, is not implemented.)
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .events import KVEventBatch, decode_batch, encode_batch
from .index import CacheIndex

__all__ = ["EventPublisher", "EventSubscriber", "IndexFollower"]


def _zmq() -> Any:
    try:
        import zmq  # imported lazily: only event streaming needs it
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "KV event streaming needs pyzmq; install it with `pip install pyzmq` "
            "(or `pip install hybridkv[events]`)"
        ) from e
    return zmq


class EventPublisher:
    """PUB socket. ``endpoint`` may end in ``:*`` to bind a random free port; the bound
    address is :attr:`endpoint`."""

    def __init__(self, endpoint: str, topic: str = "kv-events") -> None:
        zmq = _zmq()
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if endpoint.endswith(":*"):
            port = self.sock.bind_to_random_port(endpoint[:-2])
            endpoint = f"{endpoint[:-2]}:{port}"
        else:
            self.sock.bind(endpoint)
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.seq = 0

    def publish(self, batch: KVEventBatch) -> int:
        """Send one batch; returns its sequence number."""
        seq = self.seq
        self.sock.send_multipart([self.topic, seq.to_bytes(8, "big"), encode_batch(batch)])
        self.seq += 1
        return seq

    def close(self) -> None:
        self.sock.close()
        self._ctx.term()

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventSubscriber:
    """SUB socket on one topic."""

    def __init__(self, endpoint: str, topic: str = "kv-events") -> None:
        zmq = _zmq()
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(endpoint)
        self.last_seq = -1
        self.missed = 0

    def recv(self, timeout_ms: int = 1000) -> tuple[int, KVEventBatch] | None:
        """``(sequence number, batch)``, or None when nothing arrives within ``timeout_ms``."""
        if not self.sock.poll(timeout_ms):
            return None
        _, seq_b, payload = self.sock.recv_multipart()
        seq = int.from_bytes(seq_b, "big")
        if self.last_seq >= 0 and seq > self.last_seq + 1:
            self.missed += seq - self.last_seq - 1
        self.last_seq = seq
        return seq, decode_batch(payload)

    def close(self) -> None:
        self.sock.close()
        self._ctx.term()

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class IndexFollower(threading.Thread):
    """A background subscriber that applies every batch to a :class:`CacheIndex`.

    It stops by itself once it has applied the batch numbered ``until_seq`` (see :meth:`finish`)
    or after ``timeout_s`` seconds, whichever comes first; it never blocks a process exit.
    """

    def __init__(self, endpoint: str, *, topic: str = "kv-events", timeout_s: float = 10.0):
        super().__init__(daemon=True, name="kv-index-follower")
        self.sub = EventSubscriber(endpoint, topic)
        self.index = CacheIndex()
        self.first_seq: int | None = None
        self.applied = 0
        self.until_seq: int | None = None
        self.deadline = time.monotonic() + timeout_s
        self.timed_out = False

    def finish(self, until_seq: int) -> None:
        """Stop after applying batch ``until_seq``."""
        self.until_seq = until_seq

    def run(self) -> None:
        try:
            while True:
                if self.until_seq is not None and self.sub.last_seq >= self.until_seq:
                    return
                if time.monotonic() > self.deadline:
                    self.timed_out = True
                    return
                got = self.sub.recv(timeout_ms=20)
                if got is None:
                    continue
                seq, batch = got
                if self.first_seq is None:
                    self.first_seq = seq
                self.index.apply(batch)
                self.applied += 1
        finally:
            self.sub.close()
