"""The persistent buffer of a step's metadata: one int32 tensor in fixed regions.

Everything the kernels read each step (the store plan's tiles and writes, per-row lengths
and slots, each kind of row's rows, query starts and tokens) lives at a fixed offset of one
device buffer, refreshed by one host to device copy per step, so that full CUDA graphs
replay with fresh values. Regions start at 16-byte boundaries, as fresh tensors do: the
store kernels specialize on their plan pointers' alignment, so the variants warm-up compiled
on scratch tensors are the ones these views select.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

__all__ = ["ROW_KINDS", "StepBuffers"]

ROW_KINDS = ("decode", "fresh", "context")

_PER_ROW = (
    "seq_lens",
    "quantized_lens",
    "read_lens",
    "key_lens",
    "slots",
    "sink_lens",
    "sink_slots",
    "qsl",
    "drafts",
    "new_rows",
)


def _align4(n: int) -> int:
    """``n`` rounded up to a multiple of 4 (int32 entries: 16 bytes)."""
    return -(-n // 4) * 4


class StepBuffers:
    """The regions of a step's int32 buffer and the device tensor holding them.

    Args:
        max_num_reqs: rows per step (``max_num_seqs``).
        max_num_tokens: tokens per step.
        max_tiles: tiles one step's plan may complete (``[max_tiles, 5]`` region).
        max_writes: tokens one step's plan may write (``[max_writes, 4]`` region).
        device: where the buffer lives.

    Attributes:
        layout: ``{region: (start, size)}`` in int32 entries.
        device_buf: ``[total]`` int32 on ``device``.
    """

    def __init__(
        self, max_num_reqs: int, max_num_tokens: int, max_tiles: int, max_writes: int, device: Any
    ) -> None:
        r, t = max_num_reqs, max_num_tokens
        writes_at = _align4(max_tiles * 5)
        self.layout: dict[str, tuple[int, int]] = {
            "tiles": (0, max_tiles * 5),
            "writes": (writes_at, max_writes * 4),
        }
        offset = _align4(writes_at + max_writes * 4)
        sizes = [(name, r + 1 if name == "qsl" else r) for name in _PER_ROW]
        for kind in ROW_KINDS:
            sizes += [(f"{kind}_rows", r), (f"{kind}_qsl", r + 1), (f"{kind}_tokens", t)]
        # A per-token decode group (verify blocks as decode rows in a mixed step): each
        # token's batch row and how many of its block's tokens come after it.
        sizes += [("token_rows", t), ("token_after", t)]
        for name, size in sizes:
            self.layout[name] = (offset, size)
            offset = _align4(offset + size)
        self.device_buf = torch.zeros(offset, dtype=torch.int32, device=device)
        self._pin = torch.cuda.is_available() and device.type == "cuda"

    def start(self, name: str) -> int:
        """Where region ``name`` begins."""
        return self.layout[name][0]

    def view(self, buf: Any, name: str, n: int, cols: int = 1) -> Any:
        """The first ``n`` entries (``[n, cols]`` rows when ``cols > 1``) of region ``name`` of
        ``buf``: the device buffer, or a host copy of it (NumPy)."""
        start, size = self.layout[name]
        if n * cols > size:
            raise ValueError(f"{name} needs {n * cols} entries, buffer holds {size}")
        view = buf[start : start + n * cols]
        return view.view(n, cols) if cols > 1 else view

    def host(self) -> np.ndarray:
        """A zeroed host copy of the whole buffer, to fill region by region."""
        return np.zeros(self.device_buf.numel(), dtype=np.int32)

    @staticmethod
    def put(host: np.ndarray, start: int, values: Any) -> None:
        """``values`` (any int array) into ``host`` from entry ``start`` on."""
        flat = np.asarray(values, dtype=np.int32).reshape(-1)
        host[start : start + flat.size] = flat

    def upload(self, host: np.ndarray, lo: int, hi: int) -> None:
        """Entries ``[lo, hi)`` of ``host`` to the device buffer (one copy, no sync)."""
        src = torch.from_numpy(host[lo:hi])
        if self._pin:
            src = src.pin_memory()
        self.device_buf[lo:hi].copy_(src, non_blocking=True)

    def plan_out(self, config: Any, num_reqs: int, num_tiles: int, num_tokens: int) -> Any:
        """The device buffer's views a device planner writes its store plan into (what CUDA
        graphs replay): a ``StorePlan`` of ``num_tiles`` tiles and ``num_tokens`` writes with
        ``config``'s plan settings (a :class:`~kvarn_vllm.config.KvarnConfig`)."""
        from kvarn_kernels import StorePlan

        buf = self.device_buf
        return StorePlan(
            tiles=self.view(buf, "tiles", num_tiles, 5),
            writes=self.view(buf, "writes", num_tokens, 4),
            seq_lens=self.view(buf, "seq_lens", num_reqs),
            quantized_lens=self.view(buf, "quantized_lens", num_reqs),
            num_tiles=num_tiles,
            num_writes=num_tokens,
            group_size=config.preset.group_size,
            staging_tiles=config.ring_tiles,
            sink=config.sink,
            recent_tiles=config.recent_tiles,
            read_lens=self.view(buf, "read_lens", num_reqs),
            window_keys=config.window_keys,
            key_read_lens=None if config.window_keys else self.view(buf, "key_lens", num_reqs),
        )

    def plan_views(self, plan: Any, num_reqs: int, tiles: Any, writes: Any) -> Any:
        """``plan`` on the device buffer: its tiles and writes as given, its per-row lengths
        as the buffer's views (what CUDA graphs replay)."""
        buf = self.device_buf
        return replace(
            plan,
            tiles=tiles,
            writes=writes,
            seq_lens=self.view(buf, "seq_lens", num_reqs),
            quantized_lens=self.view(buf, "quantized_lens", num_reqs),
            read_lens=None if plan.read_lens is None else self.view(buf, "read_lens", num_reqs),
            key_read_lens=None
            if plan.key_read_lens is None
            else self.view(buf, "key_lens", num_reqs),
        )
