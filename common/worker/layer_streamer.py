"""Layer-wise KV sends: the blocks of a prompt whose last chunk this step computes leave layer by
layer while the step computes the layers after them.

The model calls `on_layer(i)` once layer i's KV is in the cache; a thread sends each layer as it
becomes ready (one frame per layer and transfer), the last one closing each transfer.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from common.kv_cache import PagedKVCache, on_device
from common.kv_transfer.base import KVSender, KVTransferError
from common.plans import KVSend

STOP = -1
JOIN_TIMEOUT_S = 600.0  # senders keep their own, shorter deadlines; this only bounds the join


@dataclass
class _Stream:
    send: KVSend
    sender: KVSender
    start: float = 0.0
    end: float = 0.0
    error: str = ""
    bytes: int = field(default=0)


class LayerStreamer:
    def __init__(self, cache: PagedKVCache, sends: list[tuple[KVSend, KVSender]]):
        self.cache = cache
        self.num_layers = cache.layout.num_layers
        self.streams = {s.transfer_id: _Stream(s, sender) for s, sender in sends}
        self._ready: queue.SimpleQueue = queue.SimpleQueue()  # (layer, cuda event or None)
        self._thread = threading.Thread(target=self._run, name="kv-layer-sends", daemon=True)
        self._thread.start()

    def on_layer(self, i: int) -> None:
        """Called right after layer i's kernels were queued; on a GPU they may still run, so
        the sender first waits on an event recorded behind them."""
        event = None
        if self.cache.tensor.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.cache.tensor.device))
        self._ready.put((i, event))

    def abort(self) -> None:
        """The step failed: nothing more will be sent."""
        self._ready.put((STOP, None))
        for s in self.streams.values():
            s.error = s.error or "the step computing these blocks failed"

    def finish(self) -> dict[str, _Stream]:
        """Waits for the last layer to be sent (or to fail) on every stream."""
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            for s in self.streams.values():
                s.error = s.error or "layer-wise send did not finish"
        return self.streams

    def _run(self) -> None:
        """On a GPU the sends' own copies run on a side stream of the cache's device: the
        compute stream holds the later layers' kernels, which they must not wait for (the
        layer's event was waited on by this thread already)."""
        device = self.cache.tensor.device
        if device.type != "cuda":
            # its copies on this thread alone: a second OpenMP team in the process (more of
            # libgomp's threads than cores) makes the step's team sleep between its parallel
            # regions instead of spinning, and wake for each (a 128-token bf16 prefill of the
            # 56M model: 21.6 ms with one team, 27 ms beside a second)
            torch.set_num_threads(1)
            return self._send_layers()
        with on_device(device), torch.cuda.stream(torch.cuda.Stream(device)):
            return self._send_layers()

    def _send_layers(self) -> None:
        for expected in range(self.num_layers):
            layer, event = self._ready.get()
            if layer == STOP:
                return
            assert layer == expected, f"layer {layer} ready before layer {expected}"
            if event is not None:
                event.synchronize()
            for s in self.streams.values():
                self._send(s, layer, layer + 1)

    def _send(self, s: _Stream, start: int, end: int) -> None:
        if s.error:
            return
        if not s.start:
            s.start = time.time()
        try:
            s.bytes += s.sender.send_layers(
                s.send.transfer_id, self.cache, list(s.send.src_block_ids), s.send.dst_endpoint,
                list(s.send.dst_block_ids), start, end, last=end == self.num_layers)
        except KVTransferError as e:
            s.error = str(e)
        s.end = time.time()
