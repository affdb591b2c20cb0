"""Publish KV event batches over ZMQ and rebuild a cache index from them."""

from __future__ import annotations

from typing import Any

from .events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)


def _zmq() -> Any:
    try:
        import zmq  # imported lazily: only event streaming needs it
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "KV event streaming needs pyzmq; install it with `pip install pyzmq`"
        ) from e
    return zmq


class EventPublisher:
    """PUB socket; each batch is one msgpack frame."""

    def __init__(self, endpoint: str) -> None:
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

    def publish(self, batch: KVEventBatch) -> None:
        self.sock.send(encode_batch(batch))

    def close(self) -> None:
        self.sock.close()
        self._ctx.term()


class EventSubscriber:
    """SUB socket subscribed to every batch."""

    def __init__(self, endpoint: str) -> None:
        zmq = _zmq()
        self._zmq = zmq
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)

    def recv(self, timeout_ms: int = 1000) -> KVEventBatch | None:
        """One batch, or None when nothing arrives within ``timeout_ms``."""
        if not self.sock.poll(timeout_ms):
            return None
        return decode_batch(self.sock.recv())

    def close(self) -> None:
        self.sock.close()
        self._ctx.term()


class CacheIndex:
    """The set of cached (group, hash) pairs, with parent links, rebuilt from events."""

    def __init__(self) -> None:
        self.parent: dict[tuple[int, bytes], bytes | None] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                parent = ev.parent_block_hash
                for h in ev.block_hashes:
                    self.parent[(ev.group_idx, h)] = parent
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self.parent.pop((ev.group_idx, h), None)
            elif isinstance(ev, AllBlocksCleared):
                self.parent.clear()

    @property
    def keys(self) -> set[tuple[int, bytes]]:
        return set(self.parent)
