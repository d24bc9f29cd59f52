"""Reference attention over a KVarN-quantized sequence (what the kernels are tested against).

A sequence of ``T`` tokens of ``H_kv`` KV heads is stored as

* optional exact **sink tokens** ``[0, S)`` (the attention sink, kept unquantized), ``S <= G``,
* ``num_tiles`` quantized **tile records**: with ``S = G`` (the whole first tile exact) they
  cover tokens ``[G, G + num_tiles * G)``; otherwise ``[0, num_tiles * G)``, tile 0 included, and
  reads of positions ``< S`` take the exact rows instead of tile 0's record,
* an unquantized **open tail** of fewer than ``G`` tokens (the tile still being filled),
* optional exact copies of the **recent tiles**, the last ``R`` complete tiles: their records
  exist (a prefix-cache hit reads them) but attention reads the exact rows, as a serving engine
  does that keeps them in staging besides the open tile.

The sink and the recent tiles are the **exact windows**. With ``window_keys=False`` they keep
only their values exact: their keys are read from their records (tile 0 then has a record even
with ``S = G``), which halves what an engine stages for them. The open tail stays exact, keys
and values.

Which tiles are recent is counted from the step's first new token
(:func:`recent_window_start`): a step whose queries start in tile ``t`` reads tiles
``t - R .. t`` exact, as far as the staging ring holds them.

Attention runs in the rotated frame: ``q`` is rotated, scores are ``(q H) . k_rot``, the
output ``softmax . v_rot`` is un-rotated.  Softmax is computed in float64 here (the kernels
use fp32 online softmax; float64 makes the reference the more accurate side).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvarn_math.hadamard import rotate, unrotate
from kvarn_math.layout import Preset, get_preset, tile_layout
from kvarn_math.tile import check_finite, decode_tiles, quantize_tiles

__all__ = [
    "QuantizedSequence",
    "quantize_sequence",
    "recent_window_start",
    "key_window_start",
    "step_sequence",
    "dense_kv",
    "reference_attention",
    "dense_attention",
]

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class QuantizedSequence:
    """One sequence's KV cache in KVarN form (original frame outside the records).

    Attributes:
        preset: the cache preset.
        head_dim: ``D``.
        records: ``[num_tiles, H_kv, tile_bytes]`` uint8 quantized tiles.
        tail_k, tail_v: ``[T_tail, H_kv, D]`` float32 open-tile tokens, ``T_tail < G``.
        first_k, first_v: ``[S, H_kv, D]`` float32 exact sink tokens ``[0, S)``, ``0 < S <= G``,
            or ``None``. ``S = G`` is the exact first tile (no record of tile 0 in ``records``);
            ``S < G`` overlays the first ``S`` positions of tile 0's record.
        recent_k, recent_v: ``[R*G, H_kv, D]`` float32 exact copies of the last ``R`` records'
            tokens, read instead of those records (``R <= num_tiles``), or ``None``. With
            ``window_keys=False``, ``recent_k`` may cover fewer tiles than ``recent_v`` (the
            step's own tile, whose keys stay exact), or be ``None``.
        window_keys: the exact windows (sink, recent tiles) hold keys and values. ``False``:
            values only (``first_k`` and ``recent_k`` are ``None``); their keys are read from
            the records, which then include tile 0 even when ``S = G``.
    """

    preset: Preset
    head_dim: int
    records: npt.NDArray[np.uint8]
    tail_k: F32
    tail_v: F32
    first_k: F32 | None = None
    first_v: F32 | None = None
    recent_k: F32 | None = None
    recent_v: F32 | None = None
    window_keys: bool = True

    @property
    def recent_tiles(self) -> int:
        """``R``, the complete tiles read (values, or keys and values) from exact copies."""
        return 0 if self.recent_v is None else int(self.recent_v.shape[0]) // self.preset.group_size

    @property
    def sink_tokens(self) -> int:
        """``S``, the number of leading tokens read exact (0 without a sink)."""
        return 0 if self.first_v is None else int(self.first_v.shape[0])

    @property
    def first_record(self) -> int:
        """Position of the first record's first token: ``G`` when the exact sink replaces tile
        0's record (``S = G`` with window keys), else 0."""
        g = self.preset.group_size
        return g if self.sink_tokens == g and self.window_keys else 0

    @property
    def num_tokens(self) -> int:
        """Total tokens ``T``."""
        g = self.preset.group_size
        return int(self.first_record + self.records.shape[0] * g + self.tail_k.shape[0])


def quantize_sequence(
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    preset: str | Preset,
    keep_first_tile: bool = False,
    *,
    sink_tokens: int | None = None,
    sink_requantize: bool = False,
    recent_tiles: int = 0,
    raw_keys: npt.ArrayLike = False,
    window_keys: bool = True,
    recent_key_tiles: int | None = None,
) -> QuantizedSequence:
    """Store a sequence the way the cache does.

    The sink exists once tile 0 is complete (``T >= G``); a shorter sequence is all open tail.

    Args:
        k: ``[T, H_kv, D]`` original-frame keys.
        v: ``[T, H_kv, D]`` original-frame values.
        preset: the cache preset.
        keep_first_tile: keep tokens ``[0, G)`` exact; the same as ``sink_tokens=G``.
        sink_tokens: keep tokens ``[0, S)`` exact, ``0 <= S <= G`` (0: no sink). With
            ``0 < S < G`` tile 0 is still quantized into a record, which serves positions
            ``[S, G)``. ``None``: ``G`` with ``keep_first_tile``, else 0.
        sink_requantize: with ``0 < S < G``, quantize tile 0 with its first ``S`` tokens
            replaced by copies of token ``S``, so that the sink tokens (often outliers) do not
            enter tile 0's scales; its record then does not depend on them.
        recent_tiles: ``R >= 0``: the last ``R`` records after the sink (at most all of
            them) are read from exact copies (a window of ``R`` complete tiles before the open
            one; the records are written all the same).
        raw_keys: bool, scalar or ``[num_records, H_kv]``: records whose keys are stored in
            their own channels (:func:`kvarn_math.tile.quantize_tiles`).
        window_keys: the sink and the recent tiles keep their keys exact too (the default);
            ``False``: only their values, and their keys are read from their records (tile 0
            is then quantized into a record whatever ``S``).
        recent_key_tiles: with ``window_keys=False``, the last ``R_k <= R`` recent tiles whose
            keys are exact too (default 0; :func:`step_sequence` keeps the step's own tile).

    Raises:
        ValueError: bad shapes, ``sink_tokens`` outside ``[0, G]``, ``sink_tokens``
            together with ``keep_first_tile``, or a negative ``recent_tiles``.
    """
    p = get_preset(preset)
    g = p.group_size
    if sink_tokens is None:
        sink_tokens = g if keep_first_tile else 0
    elif keep_first_tile:
        raise ValueError("give keep_first_tile or sink_tokens, not both")
    if not 0 <= sink_tokens <= g:
        raise ValueError(f"sink_tokens must be in [0, {g}] (the group size), got {sink_tokens}")
    if not isinstance(recent_tiles, int) or recent_tiles < 0:
        raise ValueError(f"recent_tiles must be an int >= 0, got {recent_tiles!r}")
    k_arr = np.asarray(k, dtype=np.float32)
    v_arr = np.asarray(v, dtype=np.float32)
    if k_arr.shape != v_arr.shape or k_arr.ndim != 3:
        raise ValueError(
            f"k and v must be [T, H_kv, D] of one shape, got {k_arr.shape}, {v_arr.shape}"
        )
    t, h, d = k_arr.shape
    tile_layout(p, d)
    sink = sink_tokens if t >= g else 0
    start = g if sink == g and window_keys else 0
    num_tiles = (t - start) // g
    end = start + num_tiles * g
    body_k, body_v = k_arr[start:end], v_arr[start:end]
    if sink_requantize and 0 < sink < g:
        body_k, body_v = body_k.copy(), body_v.copy()
        body_k[:sink] = body_k[sink]
        body_v[:sink] = body_v[sink]
    body_k = body_k.reshape(num_tiles, g, h, d).transpose(0, 2, 1, 3)
    body_v = body_v.reshape(num_tiles, g, h, d).transpose(0, 2, 1, 3)
    records = quantize_tiles(body_k, body_v, p, raw_keys=raw_keys)
    # the recent tiles are records after the sink (tile 0's record with value windows is not one)
    recent = min(recent_tiles, num_tiles - int(sink == g and start == 0)) * g
    if window_keys:
        recent_k = recent
    else:
        rk = 0 if recent_key_tiles is None else recent_key_tiles
        if not isinstance(rk, int) or rk < 0:
            raise ValueError(f"recent_key_tiles must be an int >= 0, got {recent_key_tiles!r}")
        recent_k = min(rk * g, recent)
    return QuantizedSequence(
        preset=p,
        head_dim=d,
        records=records,
        tail_k=k_arr[end:].copy(),
        tail_v=v_arr[end:].copy(),
        first_k=k_arr[:sink].copy() if sink and window_keys else None,
        first_v=v_arr[:sink].copy() if sink else None,
        recent_k=k_arr[end - recent_k : end].copy() if recent_k else None,
        recent_v=v_arr[end - recent : end].copy() if recent else None,
        window_keys=bool(window_keys),
    )


def recent_window_start(
    num_cached: int,
    seq_len: int,
    quantized_len: int,
    group_size: int,
    recent_tiles: int,
    ring_tiles: int,
    exact_start: int = 0,
) -> int:
    """The first position a step reads exact: records before it, exact rows from there on.

    A step appends tokens ``[num_cached, seq_len)``; afterwards ``quantized_len`` tokens are in
    records (a multiple of ``G``). The exact window starts ``R`` tiles before the tile of the
    step's first new token: that tile (open when the step began) and the ``R`` before it are
    read exact even where the step completes them, so a query never loses its window to a tile
    it completed itself (a decode step that completes a tile, or a tile-aligned chunk, still
    reads the ``R`` tiles before its own exact). Bounded below by

    * ``exact_start``: positions before it exist only as records (a prefix-cache hit);
    * the ring: exact rows live in ``ring_tiles`` (``S``) tiles of staging, so only the
      whole tiles of the last ``S*G`` positions ``[seq_len - S*G, seq_len)`` are there;

    and above by ``quantized_len`` (the open tokens are exact anyway). With ``R = 0`` there is
    no window: ``quantized_len``.

    Args:
        num_cached: tokens before the step.
        seq_len: tokens after the step.
        quantized_len: tokens in records after the step, a multiple of ``G``.
        group_size: ``G``.
        recent_tiles: ``R >= 0``.
        ring_tiles: ``S >= 1``, staging tiles per request (open ones and recent ones).
        exact_start: first position the request wrote itself, a multiple of ``G``.

    Raises:
        ValueError: lengths out of order or not tile multiples, negative ``R``, ``S < 1``.
    """
    if not isinstance(recent_tiles, int) or recent_tiles < 0:
        raise ValueError(f"recent_tiles must be an int >= 0, got {recent_tiles!r}")
    start = _window_start(
        num_cached, seq_len, quantized_len, group_size, recent_tiles, ring_tiles, exact_start
    )
    return quantized_len if recent_tiles == 0 else start


def _window_start(
    num_cached: int,
    seq_len: int,
    quantized_len: int,
    g: int,
    back_tiles: int,
    ring_tiles: int,
    exact_start: int,
) -> int:
    """``min(quantized_len, max(exact_start, window, ring))``: ``window`` starts ``back_tiles``
    tiles before the tile of the step's first new token, ``ring`` at the first whole tile of the
    last ``ring_tiles * G`` positions; the arguments checked."""
    if not isinstance(ring_tiles, int) or ring_tiles < 1:
        raise ValueError(f"ring_tiles must be an int >= 1, got {ring_tiles!r}")
    if not 0 <= num_cached <= seq_len or not 0 <= quantized_len <= seq_len:
        raise ValueError(
            f"need 0 <= num_cached ({num_cached}) <= seq_len ({seq_len}) and 0 <= "
            f"quantized_len ({quantized_len}) <= seq_len"
        )
    if quantized_len % g or exact_start % g or not 0 <= exact_start <= num_cached:
        raise ValueError(
            f"quantized_len ({quantized_len}) and exact_start ({exact_start}) must be "
            f"multiples of G={g}, exact_start in [0, num_cached={num_cached}]"
        )
    window = (num_cached // g - back_tiles) * g
    ring = -(-(seq_len - ring_tiles * g) // g) * g  # whole tiles of the last S*G positions
    return min(quantized_len, max(exact_start, window, ring))


def key_window_start(
    num_cached: int,
    seq_len: int,
    quantized_len: int,
    group_size: int,
    open_tiles: int,
    exact_start: int = 0,
) -> int:
    """With values-only windows (``window_keys=False``), the first position whose key a step
    reads exact: the tile of the step's first new token (open when the step began), as far as
    the key ring of ``open_tiles`` tiles holds it; records before it.

    ``min(quantized_len, max(exact_start, floor(num_cached / G) * G, ring))`` with ``ring`` the
    whole tiles of the last ``open_tiles * G`` positions: :func:`recent_window_start` with
    ``R = 0`` counted from the step's first token, so a step that completes its tile (a decode
    step, a tile-aligned chunk) still reads that tile's keys exact.
    """
    if not isinstance(open_tiles, int) or open_tiles < 1:
        raise ValueError(f"open_tiles must be an int >= 1, got {open_tiles!r}")
    return _window_start(num_cached, seq_len, quantized_len, group_size, 0, open_tiles, exact_start)


def step_sequence(
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    preset: str | Preset,
    num_cached: int,
    *,
    recent_tiles: int,
    ring_tiles: int,
    exact_start: int = 0,
    keep_first_tile: bool = False,
    window_keys: bool = True,
    open_tiles: int | None = None,
) -> QuantizedSequence:
    """The sequence as a step that appended ``[num_cached, T)`` reads it (no speculation).

    :func:`quantize_sequence` with its recent window from :func:`recent_window_start`: the
    records from the window's start on are read exact.

    Args:
        k: ``[T, H_kv, D]`` original-frame keys after the step.
        v: ``[T, H_kv, D]`` original-frame values after the step.
        preset: the cache preset.
        num_cached: tokens before the step.
        recent_tiles: ``R``, as :func:`recent_window_start`.
        ring_tiles: ``S``, as :func:`recent_window_start`.
        exact_start: as :func:`recent_window_start`.
        keep_first_tile: as :func:`quantize_sequence` (the sink tile is read exact anyway).
        window_keys: as :func:`quantize_sequence`; ``False`` reads the window's keys from
            their records, except those of the step's own tile (:func:`key_window_start`).
        open_tiles: the key ring's tiles with ``window_keys=False`` (default
            ``ring_tiles - recent_tiles``).
    """
    p = get_preset(preset)
    g = p.group_size
    t = int(np.shape(k)[0])
    quantized = t // g * g
    read = recent_window_start(num_cached, t, quantized, g, recent_tiles, ring_tiles, exact_start)
    first = g if keep_first_tile and t >= g else 0  # tile 0 is read exact (values at least)
    recent = max(0, quantized - max(read, first)) // g
    recent_keys = None
    if not window_keys:
        opened = ring_tiles - recent_tiles if open_tiles is None else open_tiles
        key_read = key_window_start(num_cached, t, quantized, g, opened, exact_start)
        recent_keys = max(0, quantized - max(key_read, first)) // g
        if key_read < first:
            # the step's own tile is tile 0: its keys are read exact too (what attention reads;
            # the engine also keeps tile 0's record, which nothing reads in this step)
            window_keys = True
    return quantize_sequence(
        k,
        v,
        p,
        keep_first_tile=keep_first_tile,
        recent_tiles=recent,
        window_keys=window_keys,
        recent_key_tiles=recent_keys,
    )


def dense_kv(seq: QuantizedSequence) -> tuple[F32, F32]:
    """The rotated-frame K and V ``[T, H_kv, D]`` float32 that attention sees."""
    p, d = seq.preset, seq.head_dim
    k_tiles, v_tiles = decode_tiles(seq.records, p, d)  # [N, H, G, D]
    n, h = seq.records.shape[:2]
    parts_k = [k_tiles.transpose(0, 2, 1, 3).reshape(n * p.group_size, h, d)]
    parts_v = [v_tiles.transpose(0, 2, 1, 3).reshape(n * p.group_size, h, d)]
    sink = seq.sink_tokens
    if seq.first_record and seq.first_k is not None and seq.first_v is not None:
        parts_k.insert(0, rotate(seq.first_k, axis=-1))  # tile 0 has no record
        parts_v.insert(0, rotate(seq.first_v, axis=-1))
    parts_k.append(rotate(seq.tail_k, axis=-1))
    parts_v.append(rotate(seq.tail_v, axis=-1))
    k_rot = np.concatenate(parts_k).astype(np.float32)
    v_rot = np.concatenate(parts_v).astype(np.float32)
    if sink and not seq.first_record and seq.first_v is not None:
        # the sink overlays tile 0's record: its values, and its keys with window keys
        v_rot[:sink] = rotate(seq.first_v, axis=-1)
        if seq.first_k is not None:
            k_rot[:sink] = rotate(seq.first_k, axis=-1)
    if seq.recent_v is not None and seq.recent_v.shape[0]:
        # the recent tiles: exact rows instead of their records (values only without keys)
        end = v_rot.shape[0] - seq.tail_v.shape[0]
        v_rot[end - seq.recent_v.shape[0] : end] = rotate(seq.recent_v, axis=-1)
        if seq.recent_k is not None:
            k_rot[end - seq.recent_k.shape[0] : end] = rotate(seq.recent_k, axis=-1)
    return k_rot, v_rot


def dense_attention(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> F32:
    """Causal GQA attention of the last ``T_q`` positions over exact K/V.

    Args:
        q: ``[T_q, H_q, D]``; query ``i`` sits at position ``T - T_q + i``.
        k: ``[T, H_kv, D]``; ``H_q`` a multiple of ``H_kv`` (query head ``h`` reads KV head
            ``h // (H_q / H_kv)``).
        v: ``[T, H_kv, D]``.
        scale: softmax scale, default ``1 / sqrt(D)``.
        sliding_window: if set, a query at position ``p`` sees keys ``(p - window, p]``.

    Returns:
        ``[T_q, H_q, D]`` float32.
    """
    q_arr = np.asarray(q, dtype=np.float64)
    k_arr = np.asarray(k, dtype=np.float64)
    v_arr = np.asarray(v, dtype=np.float64)
    check_finite(q_arr, "q")
    tq, hq, d = q_arr.shape
    t, hkv, dk = k_arr.shape
    if dk != d or v_arr.shape != k_arr.shape:
        raise ValueError(f"q {q_arr.shape}, k {k_arr.shape} and v {v_arr.shape} disagree")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if tq > t:
        raise ValueError(f"{tq} query tokens but only {t} cached tokens")
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    group = hq // hkv
    k_full = np.repeat(k_arr, group, axis=1)  # [T, H_q, D]
    v_full = np.repeat(v_arr, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q_arr, k_full) * scale  # [H_q, T_q, T]
    q_pos = np.arange(t - tq, t)[:, None]
    k_pos = np.arange(t)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    scores = np.where(visible[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out: F32 = np.einsum("hqk,khd->qhd", probs, v_full).astype(np.float32)
    return out


def reference_attention(
    q: npt.ArrayLike,
    seq: QuantizedSequence,
    scale: float | None = None,
    sliding_window: int | None = None,
    exact_kv: tuple[npt.ArrayLike, npt.ArrayLike] | None = None,
) -> F32:
    """Attention of ``T_q`` query tokens (the sequence's last positions) over a quantized sequence.

    Args:
        q: ``[T_q, H_q, D]`` original-frame queries; ``T_q = 1`` is decode, more is a
            speculative verify or chunked-prefill continuation (causal among themselves).
        seq: the stored sequence (its last ``T_q`` tokens are the queries' own K/V).
        scale: softmax scale, default ``1 / sqrt(D)``.
        sliding_window: optional window in tokens.
        exact_kv: optional original-frame ``(k, v)``, each ``[T_q, H_kv, D]``: the queries' own
            K/V, attended exactly instead of as stored (a chunk of several tokens attends its
            own tokens exact, as a first chunk and decoding do, even where this step
            completed their tiles; earlier positions are read as stored).

    Returns:
        ``[T_q, H_q, D]`` float32 in the original frame.
    """
    k_rot, v_rot = dense_kv(seq)
    if exact_kv is not None:
        tq = np.asarray(q).shape[0]
        ek = np.asarray(exact_kv[0], dtype=np.float32)
        ev = np.asarray(exact_kv[1], dtype=np.float32)
        want = (tq, *k_rot.shape[1:])
        if ek.shape != want or ev.shape != want:
            raise ValueError(
                f"exact_kv must be two [T_q, H_kv, D] = {list(want)} arrays, got "
                f"{list(ek.shape)} and {list(ev.shape)}"
            )
        k_rot[k_rot.shape[0] - tq :] = rotate(ek, axis=-1)
        v_rot[v_rot.shape[0] - tq :] = rotate(ev, axis=-1)
    q_rot = rotate(np.asarray(q, dtype=np.float32), axis=-1)
    out_rot = dense_attention(q_rot, k_rot, v_rot, scale=scale, sliding_window=sliding_window)
    return unrotate(out_rot, axis=-1).astype(np.float32)
