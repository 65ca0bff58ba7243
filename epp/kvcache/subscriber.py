"""ZMQ subscribers feeding vLLM's KV events into a :class:`~epp.kvcache.index.BlockIndex`.

Modelled on llm-d-router v0.10.0 ``pkg/kvevents/zmq_subscriber.go``,
``subscriber_manager.go`` and the precise-prefix-cache-producer's ``extractor.go``
(own Python, pyzmq asyncio).

Addresses (llm-d's rule, ``ensureSubscriber``): an endpoint ``address:port`` (data
parallel rank ``r``, 0 here) publishes on ``tcp://<address>:<socketPort + r>`` (vLLM's
``--kv-events-config '{"endpoint": "tcp://*:5557", ...}'``, socketPort 5557 by default)
and, when ``replaySocketPort`` is set, answers replays on
``tcp://<address>:<replaySocketPort + r>``. Its blocks are indexed under
``address:port`` — the endpoint's key. Pods sharing one address (a single-host pool,
distinct HTTP ports) cannot all publish on ``socketPort``: with this project's
``podDiscoveryConfig.endpointPortOffset`` N the endpoint ``address:port`` is dialled on
``port + N`` instead (the producer computes it; ``epp sim --kv-events-port-offset N``
publishes there). In the global-socket mode
(``kvEventsConfig.zmqEndpoint``) the EPP *binds* one SUB socket that the engines connect
to, and the pod is read from the topic ``kv@<pod>@<model>``.

Ordering (per publisher): sequence numbers grow by one per batch.

* a repeated number is a duplicate and is dropped;
* a lower number means the publisher restarted: everything indexed for that pod is
  dropped, then the batch is applied (llm-d rebuilds the same way);
* a jump (a gap: batches lost, e.g. over the PUB high-water mark or across a reconnect)
  with a replay socket: the missing batches are requested (``[b"", seq (8 bytes BE)]`` on
  a DEALER; answers ``[b"", seq, payload]`` until ``END_SEQ``); if the replay fails, or
  without a replay socket, the pod's entries are dropped and indexing restarts from this
  batch — a stale entry would route requests to a pod that no longer holds the blocks;
* the first batch received after (re)connecting with a number above 0 and a replay
  socket: a replay from 0 is requested ("joining mid-stream").

A socket error closes the socket, waits ``retry_interval`` and connects again (counted
as a reconnection). :meth:`SubscriberManager.remove` stops a pod's subscriber and drops
its entries (the pod left the pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from epp.kvcache.events import END_SEQ, EventDecodeError, decode_batch, parse_frames, parse_topic
from epp.kvcache.index import BlockIndex

log = logging.getLogger(__name__)

__all__ = ["SubscriberManager", "SubscriberStats", "ZmqSubscriber", "zmq_addresses"]

DEFAULT_SOCKET_PORT = 5557
DEFAULT_TOPIC_FILTER = "kv@"


def zmq_addresses(address: str, socket_port: int, replay_port: int | None = None,
                  rank: int = 0) -> tuple[str, str | None]:
    """llm-d's endpoint → ZMQ address rule (IPv6 literals bracketed)."""
    host = f"[{address}]" if ":" in address and not address.startswith("[") else address
    pub = f"tcp://{host}:{socket_port + rank}"
    replay = f"tcp://{host}:{replay_port + rank}" if replay_port and replay_port > 0 else None
    return pub, replay


@dataclass
class SubscriberStats:
    """Counters with llm-d's metric meanings (``kv_cache_events_*``)."""

    messages: int = 0
    reconnections: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    gaps: int = 0
    restarts: int = 0
    replays: int = 0

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


class ZmqSubscriber:
    """One SUB socket: connects to a pod's publisher (``pod`` set) or binds the global
    socket (``bind=True``; pods from the topic)."""

    def __init__(self, index: BlockIndex, endpoint: str, *, pod: str | None = None,
                 replay_endpoint: str | None = None, topic_filter: str = DEFAULT_TOPIC_FILTER,
                 bind: bool = False, default_model: str = "", retry_interval: float = 5.0,
                 replay_timeout: float = 2.0, ctx: zmq.asyncio.Context | None = None,
                 stats: SubscriberStats | None = None,
                 on_apply: Callable[[str], None] | None = None) -> None:
        self.index = index
        self.endpoint = endpoint
        self.pod = pod
        self.replay_endpoint = replay_endpoint
        self.topic_filter = topic_filter
        self.bind = bind
        self.default_model = default_model
        self.retry_interval = retry_interval
        self.replay_timeout = replay_timeout
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self.stats = stats or SubscriberStats()
        self.on_apply = on_apply
        # publisher (pod) -> last sequence applied
        self._last: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"kv-events {self.endpoint}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        first = True
        while True:
            if not first:
                self.stats.reconnections += 1
                await asyncio.sleep(self.retry_interval)
            first = False
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                try:
                    if self.bind:
                        sock.bind(self.endpoint)
                    else:
                        sock.connect(self.endpoint)
                    sock.setsockopt_string(zmq.SUBSCRIBE, self.topic_filter)
                except zmq.ZMQError as e:
                    self.stats.error("bind" if self.bind else "connect")
                    log.warning("kv-events: cannot %s %s: %s",
                                "bind" if self.bind else "connect to", self.endpoint, e)
                    continue
                self.connected.set()
                self._last.clear()  # a new connection may have missed anything
                await self._receive(sock)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                self.stats.error("recv")
                log.warning("kv-events: receive from %s failed: %s; reconnecting",
                            self.endpoint, e)
            finally:
                self.connected.clear()
                sock.close(linger=0)

    async def _receive(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            self.stats.messages += 1
            try:
                topic, seq, payload = parse_frames(frames)
            except EventDecodeError as e:
                self.stats.error("frame")
                log.debug("kv-events from %s: %s", self.endpoint, e)
                continue
            await self.handle(topic, seq, payload)

    # ------------------------------------------------------------------ ordering

    def _source(self, topic: str) -> tuple[str, str]:
        topic_pod, model = parse_topic(topic)
        return (self.pod or topic_pod), (model or self.default_model)

    async def handle(self, topic: str, seq: int, payload: bytes) -> None:
        """Apply one message, with the sequence rules of the module docstring."""
        pod, model = self._source(topic)
        last = self._last.get(pod)
        if last is not None:
            if seq == last:
                return
            if seq < last:
                self.stats.restarts += 1
                log.info("kv-events: %s restarted (sequence %d after %d); dropping its "
                         "index entries", pod, seq, last)
                self.index.clear_pod(pod)
                self._last.pop(pod, None)
                if seq > 0:
                    await self._replay(pod, model, 0, seq)
            elif seq > last + 1:
                self.stats.gaps += 1
                log.info("kv-events: %s gap (sequence %d after %d, %d lost)",
                         pod, seq, last, seq - last - 1)
                if not await self._replay(pod, model, last + 1, seq):
                    self.index.clear_pod(pod)
        elif seq > 0 and self.replay_endpoint:
            await self._replay(pod, model, 0, seq)
        self._apply(pod, model, seq, payload)

    def _apply(self, pod: str, model: str, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except EventDecodeError as e:
            self.stats.error("decode")
            log.warning("kv-events from %s (seq %d): %s", pod, seq, e)
            self._last[pod] = seq
            return
        self.index.apply(pod, model, batch)
        self._last[pod] = seq
        if self.on_apply is not None:
            self.on_apply(pod)

    async def _replay(self, pod: str, model: str, start: int, until: int) -> bool:
        """Fetch and apply batches ``start <= seq < until`` from the replay socket; False
        when there is none or it did not deliver them all."""
        if not self.replay_endpoint:
            return False
        self.stats.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        got = start
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(int(self.replay_timeout * 1000)):
                    self.stats.error("replay-timeout")
                    return False
                frames = await dealer.recv_multipart()
                if len(frames) != 3:
                    continue
                _, seq_b, payload = frames
                if seq_b == END_SEQ:
                    return got >= until
                seq = int.from_bytes(seq_b, "big")
                if seq < start or seq >= until:
                    continue
                if seq != got:  # the publisher's buffer no longer holds what we missed
                    return False
                self._apply(pod, model, seq, payload)
                got = seq + 1
        except zmq.ZMQError as e:
            self.stats.error("replay")
            log.warning("kv-events: replay from %s failed: %s", self.replay_endpoint, e)
            return False
        finally:
            dealer.close(linger=0)


class SubscriberManager:
    """One subscriber per pod (llm-d's ``SubscriberManager``)."""

    def __init__(self, index: BlockIndex, *, topic_filter: str = DEFAULT_TOPIC_FILTER,
                 retry_interval: float = 5.0, stats: SubscriberStats | None = None) -> None:
        self.index = index
        self.topic_filter = topic_filter
        self.retry_interval = retry_interval
        self.stats = stats or SubscriberStats()
        self._subs: dict[str, ZmqSubscriber] = {}

    def ensure(self, pod: str, endpoint: str, replay_endpoint: str | None = None,
               *, bind: bool = False, default_model: str = "") -> ZmqSubscriber:
        """Start (or keep) the subscriber of ``pod``; one whose address changed is
        replaced and the pod's entries dropped. Needs a running event loop."""
        cur = self._subs.get(pod)
        if cur is not None and cur.endpoint == endpoint and cur.replay_endpoint == replay_endpoint:
            cur.start()
            return cur
        if cur is not None:
            self._stop_later(cur)
            self.index.clear_pod(pod)
        sub = ZmqSubscriber(self.index, endpoint, pod=None if bind else pod,
                            replay_endpoint=replay_endpoint, topic_filter=self.topic_filter,
                            bind=bind, default_model=default_model,
                            retry_interval=self.retry_interval, stats=self.stats)
        self._subs[pod] = sub
        sub.start()
        return sub

    def remove(self, pod: str) -> None:
        """Stop ``pod``'s subscriber and drop its entries (the pod left)."""
        sub = self._subs.pop(pod, None)
        if sub is not None:
            self._stop_later(sub)
        self.index.clear_pod(pod)

    @staticmethod
    def _stop_later(sub: ZmqSubscriber) -> None:
        try:
            asyncio.get_running_loop().create_task(sub.stop())
        except RuntimeError:  # no loop: nothing is running
            pass

    def active(self) -> list[str]:
        return sorted(p for p, s in self._subs.items() if s.running)

    def get(self, pod: str) -> ZmqSubscriber | None:
        return self._subs.get(pod)

    async def shutdown(self) -> None:
        subs, self._subs = list(self._subs.values()), {}
        await asyncio.gather(*(s.stop() for s in subs))
