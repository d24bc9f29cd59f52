"""Counting the tiles the store saturates, per layer, and saying so once.

A record holds tiles up to about ``5.4e8`` in magnitude (``docs/reliability.md``); the store
kernel saturates a tile half (the keys or the values of one KV head over one tile) it cannot
hold, since a kernel cannot raise, and adds 1 to an int32 counter it is given
(``kvarn_kernels.store_kv(overflow_count=)``). Each attention layer gets its own counter here,
a view into one device buffer per device, at model build. Nothing reads it in the hot path:
the counters are persistent tensors (CUDA-graph replays add to them as eager steps do), and
:meth:`OverflowCounters.poll`, called by the metadata builder once per step, only looks at the
clock; every ``interval`` seconds it enqueues one asynchronous copy of each buffer to pinned
host memory and reads the previous copy once its event says it has landed (no host sync).
A layer whose count first turns nonzero is named in one ``logging.warning``; at process exit
(:meth:`OverflowCounters.report_now`, synchronous) one more warning gives the totals of the
layers whose counts grew after their first warning.
"""

from __future__ import annotations

import atexit
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["COUNTERS", "RANGE_NOTE", "OverflowCounters"]

logger = logging.getLogger("vllm.kvarn")  # inherits vLLM's handler and level

RANGE_NOTE = "|x| past about 5.4e8, what a record holds"
"""The bound named in the warning (docs/reliability.md, measured with record_range.py)."""

CHUNK = 256
"""Counters per device buffer (a model with more attention layers gets another buffer)."""
STRIDE = 4
"""int32 elements between two counters: each starts on 16 bytes, as the warm-up's scratch
counter does (Triton specializes pointers on 16-byte alignment: another alignment would
compile another store variant while serving)."""


@dataclass
class _Buffer:
    """One device buffer of ``CHUNK`` int32 counters ``STRIDE`` elements apart, the layers that
    own its first ones (in order), and its host copy in flight (pinned memory and the event
    recorded after the copy)."""

    device: torch.device
    counts: torch.Tensor
    names: list[str] = field(default_factory=list)
    host: torch.Tensor | None = None
    event: Any = None


class OverflowCounters:
    """The process's saturation counters (one per attention layer that stores K/V).

    Args:
        interval: seconds between two looks at the counters in :meth:`poll`.
    """

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._buffers: list[_Buffer] = []
        self._reported: dict[tuple[int, int], int] = {}  # (buffer, index) -> count warned of
        self._next = 0.0
        self._exit_hook = False

    def allocate(self, layer_name: str | None, device: torch.device | str) -> torch.Tensor:
        """A zeroed int32 ``[1]`` counter on ``device`` for ``layer_name`` (a view into a
        shared buffer; the name appears in the warnings)."""
        device = torch.device(device)
        buf = next((b for b in self._buffers if b.device == device and len(b.names) < CHUNK), None)
        if buf is None:
            buf = _Buffer(device, torch.zeros(CHUNK * STRIDE, dtype=torch.int32, device=device))
            self._buffers.append(buf)
        index = len(buf.names)
        buf.names.append(layer_name or f"<attention layer {index} of buffer {len(self._buffers)}>")
        if not self._exit_hook:
            atexit.register(self._report_at_exit)
            self._exit_hook = True
        return buf.counts[index * STRIDE : index * STRIDE + 1]

    def poll(self, now: float | None = None) -> None:
        """Cheap, once per step: every ``interval`` seconds, report the copies that have
        landed and enqueue new ones. Never waits for the device; skipped while a CUDA graph
        is being captured."""
        now = time.monotonic() if now is None else now
        if now < self._next or not self._buffers:
            return
        self._next = now + self.interval
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        landed = {}
        for i, buf in enumerate(self._buffers):
            if buf.event is not None and not buf.event.query():
                continue  # the last copy has not landed: look again next time
            if buf.host is not None:
                landed[i] = buf.host.clone()
            self._copy(buf)
        self._report(landed, final=False)

    def report_now(self) -> dict[str, int]:
        """Read every counter (a host sync) and warn of what grew since the last warning.
        Returns ``{layer name: saturated tile halves}`` of the layers with any."""
        counts = {i: buf.counts.to("cpu", copy=True) for i, buf in enumerate(self._buffers)}
        self._report(counts, final=True)
        return {
            self._buffers[i].names[j]: int(c[j * STRIDE])
            for i, c in counts.items()
            for j in range(len(self._buffers[i].names))
            if int(c[j * STRIDE])
        }

    def _copy(self, buf: _Buffer) -> None:
        if buf.device.type != "cuda":
            buf.host = buf.counts.to("cpu", copy=True)
            return
        if buf.host is None:
            buf.host = torch.zeros(CHUNK * STRIDE, dtype=torch.int32, pin_memory=True)
            buf.event = torch.cuda.Event()
        buf.host.copy_(buf.counts, non_blocking=True)
        buf.event.record()

    def _report(self, counts: dict[int, torch.Tensor], final: bool) -> None:
        found = []
        for i, c in counts.items():
            for j, name in enumerate(self._buffers[i].names):
                n, before = int(c[j * STRIDE]), self._reported.get((i, j), 0)
                if n > before and (final or before == 0):
                    found.append(f"{name}: {n}")
                    self._reported[(i, j)] = n
        if not found:
            return
        logger.warning(
            "kvarn: %skeys or values beyond the format's range (%s) were stored saturated; "
            "tiles (one KV head's keys or values over one tile) by layer: %s. Attention over "
            "them is wrong: serve this model with kv_cache_dtype auto (docs/reliability.md).",
            "in total so far: " if final else "",
            RANGE_NOTE,
            "; ".join(found),
        )

    def _report_at_exit(self) -> None:
        try:
            self.report_now()
        except Exception:  # the device may be gone at exit: nothing left to report then
            logger.debug("kvarn: could not read the overflow counters at exit", exc_info=True)


COUNTERS = OverflowCounters()
"""The counters of this process (a vLLM worker serves one engine)."""
