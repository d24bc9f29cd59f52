"""Quantizer variants KVARN.md proposes to test, against the plain preset (perplexity, CPU).

KVARN.md lists ideas "worth testing (each costs bytes or time; keep the ones that pay)". Those
that leave a tile's bytes as they are (and a few of our own) are measured here under
pseudo-decode (WikiText-2, 8 x 1024 tokens, blocks of 128, first block exact, reference bf16;
SmolLM2, or Gemma-3 with ``--model gemma3-270m --tokens 512``), each paired chunk by chunk
against the plain preset:

* ``clip`` / ``clip_v``: "clipping chosen to minimise error rather than min/max range".
  kvarn-math's experimental ``clip_ratios`` also tries each row's RTN range shrunk about its
  midpoint by each ratio and keeps the candidate with the least squared error; on keys and
  values, or on values only (the 2-bit half of k4v2).
* ``signsN``: "random-sign Hadamard", ``diag(s) H`` with ``s = kvarn_math.random_signs(D, N)``
  instead of ``H`` (applied as a sign flip of the channels before the preset's own rotation and
  after its inverse; the flips are orthogonal, so attention is unchanged by them).
* ``kXvY``: other key / value bits at the same tile; ``k3v3`` stores exactly k4v2's bytes, so
  it could replace k4v2 in any layer without changing the page size ("more bits for the few
  layers or heads that are most sensitive, at the same average").
* ``refitN`` / ``refitN_v``: after RTN, refit each row's step and zero point to its codes by
  least squares and re-round, ``N`` times (keys and values, or values only); the same bytes.
* ``norot_k`` / ``norot``: no Hadamard rotation for the keys (or keys and values): the
  channels are quantized as they come, as KIVI does (fed through the preset's own rotation
  after its inverse, so the rotations cancel). KVARN.md traces kvarn_k2v2's loss to KIVI-2 on
  Gemma-3 to the rotation spreading outlier key channels.
* ``autorot_tile`` / ``autorot_seq``: keys rotated or not, whichever reconstructs the tile with
  the smaller squared error; decided per tile, or per KV head on its first tile (one flag per
  sequence and head).
* ``autorot_q_tile`` / ``autorot_q_seq``: the same choice by the attention-score error
  ``sum (q . (k_hat - k))^2`` over the queries of the tile's own positions (which an engine has
  when it stores a tile from a prefill chunk), per tile or once per head from the first tile.
  ``autorot_q_last``: per tile, from the queries of the tile's last position only (what a
  decode step that completes the tile holds). ``autorot_qe_tile`` / ``autorot_qe_last``: the
  same choices by ``kvarn_math.tile.choose_key_frames``'s estimate (no quantization: channel
  ranges weighted by the queries' channel energy), what the served store computes.
* ``recentN``: "a short exact window of the most recent tokens besides the open tile": each
  query also reads the ``N`` complete tiles before its own exact (every other variant is run
  that way too, as ``<variant>+recentN``).
  The records are the same; a serving engine would keep those tiles in staging (``N`` more
  tiles per request slot and layer).
* ``itersN``: ``N`` variance-normalization sweeps instead of kvarn-math's default (8 until
  2026-11-30, 2 since). The sweeps are most of the store's GPU time (H200, 2026-11-30, the
  launcher's 16 warps: 2.07 ms per layer and 16K-token prompt with 8, 0.82 with 2, 0.23 with
  none; Llama-3.1-8B shape), which was 15% of a 16K prefill with 8.

The ``log8`` variant (one-byte balancing factors) measured neutral here and is the record format
since; its numbers stay in ``docs/results/cpu-2026-11-30/recipe_sweep_log8_*.json``.

    python packages/kvarn-eval/scripts/recipe_sweep.py [--model M] [--variants clip,signs0]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

BLOCK = 128
REPO = Path(__file__).resolve().parents[3]


def refit(q, x, iters: int):  # type: ignore[no-untyped-def]
    """``iters`` rounds of: refit each row's ``(step, lo)`` to its codes by least squares, then
    re-round the row to the refitted grid (the squared error never grows); returns a
    :class:`kvarn_math.rtn.RowQuantized`."""
    import numpy as np
    from kvarn_math.rtn import RowQuantized

    x = np.asarray(x, dtype=np.float32)
    levels = np.float32(2**q.bits - 1)
    n = np.float32(x.shape[-1])
    sx = x.sum(-1)

    def fit(codes, step, lo):  # type: ignore[no-untyped-def]
        """Least-squares ``(step, lo)`` of each row to its codes; rows without a grid to fit
        (all codes equal) or with a non-positive fitted step keep theirs."""
        sq, sqq, sxq = codes.sum(-1), (codes * codes).sum(-1), (x * codes).sum(-1)
        det = n * sqq - sq * sq
        ok = det > 1e-6 * n * n
        new_step = np.where(ok, (n * sxq - sq * sx) / np.where(ok, det, 1), step)
        ok &= new_step > 0
        step = np.where(ok, new_step, step).astype(np.float32)
        return step, np.where(ok, (sx - step * sq) / n, lo).astype(np.float32)

    codes, step, lo = q.codes.astype(np.float32), q.step, q.lo
    for _ in range(iters):
        step, lo = fit(codes, step, lo)
        safe = np.where(step > 0, step, np.float32(1))
        codes = np.clip(np.rint((x - lo[..., None]) / safe[..., None]), 0, levels)
        codes = np.where(step[..., None] > 0, codes, 0).astype(np.float32)
    step, lo = fit(codes, step, lo)  # to the final codes: the grid the record stores
    return RowQuantized(codes=codes.astype(np.uint8), step=step, lo=lo, bits=q.bits)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m or gemma3-270m")
    parser.add_argument("--preset", default="kvarn_k4v2_g128")
    parser.add_argument("--ratios", default="0.95,0.9,0.85,0.8,0.75,0.7", help="for clip*")
    parser.add_argument("--variants", default="clip,clip_v,signs0,signs1,signs2")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--tag", default="recipe_sweep", help="output file: TAG_MODEL.json")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "cpu-2026-11-30")
    args = parser.parse_args()
    ratios = tuple(float(r) for r in args.ratios.split(","))

    from kvarn_eval.accuracy import evaluate_perplexity, install, select_methods
    from kvarn_eval.accuracy.summary import paired_change
    from kvarn_eval.data import find_wikitext
    from kvarn_eval.models import load_model
    from kvarn_eval.suites import text_chunks
    from kvarn_math.baselines import KVarN, Method
    from kvarn_math.hadamard import random_signs, rotate, unrotate
    from kvarn_math.layout import Preset

    plain = KVarN.of(args.preset)
    clipped = KVarN.of(args.preset, clip_ratios=ratios)

    @dataclass(frozen=True)
    class ValuesClipped(Method):
        """Keys as the plain preset, values with the clip search (records are per half)."""

        name: str = f"{args.preset}+clip_v"

        def bytes_per_token_per_head(self, head_dim: int) -> float:
            return plain.bytes_per_token_per_head(head_dim)

        def roundtrip(self, k, v):  # type: ignore[no-untyped-def]
            return plain.roundtrip(k, v)[0], clipped.roundtrip(k, v)[1]

    @dataclass(frozen=True)
    class RandomSigns(Method):
        """The plain preset behind a seeded channel sign flip: diag(s) H instead of H."""

        name: str = f"{args.preset}+signs0"
        seed: int = 0

        def bytes_per_token_per_head(self, head_dim: int) -> float:
            return plain.bytes_per_token_per_head(head_dim)

        def roundtrip(self, k, v):  # type: ignore[no-untyped-def]
            s = random_signs(k.shape[-1], self.seed).astype("float32")
            k_hat, v_hat = plain.roundtrip(k * s, v * s)
            return k_hat * s, v_hat * s

    @dataclass(frozen=True)
    class NoRotation(Method):
        """The plain preset without its Hadamard rotation on the keys (``values`` too): the
        input is rotated first, so the preset's rotation (its own inverse) cancels it."""

        name: str = f"{args.preset}+norot_k"
        values: bool = False

        def bytes_per_token_per_head(self, head_dim: int) -> float:
            return plain.bytes_per_token_per_head(head_dim)

        def roundtrip(self, k, v):  # type: ignore[no-untyped-def]
            k_in = rotate(k).astype("float32")
            v_in = rotate(v).astype("float32") if self.values else v
            k_hat, v_hat = plain.roundtrip(k_in, v_in)
            k_out = unrotate(k_hat).astype("float32")
            return k_out, (unrotate(v_hat).astype("float32") if self.values else v_hat)

    @dataclass(frozen=True)
    class AutoRotation(Method):
        """Keys rotated or not, whichever reconstructs with the smaller squared error: per
        tile (``autorot_tile``), or per KV head from the head's first tile and then for all
        its tiles (``autorot_seq``; a sequence-level choice an engine can make once)."""

        name: str = f"{args.preset}+autorot_tile"
        per_tile: bool = True

        def bytes_per_token_per_head(self, head_dim: int) -> float:
            return plain.bytes_per_token_per_head(head_dim)

        def roundtrip(self, k, v):  # type: ignore[no-untyped-def]
            import numpy as np

            k = np.asarray(k, dtype=np.float32)
            k_rot, v_hat = plain.roundtrip(k, v)
            k_raw = unrotate(plain.roundtrip(rotate(k).astype("float32"), v)[0])
            g = plain.group_size
            err_rot = ((k_rot - k) ** 2).reshape(-1, g, *k.shape[1:]).sum(axis=(1, 3))
            err_raw = ((k_raw - k) ** 2).reshape(-1, g, *k.shape[1:]).sum(axis=(1, 3))
            raw = err_raw < err_rot  # [tiles, heads]
            if not self.per_tile:
                raw = np.broadcast_to(raw[:1], raw.shape)
            pick = np.repeat(raw, g, axis=0)[:, :, None]
            return np.where(pick, k_raw, k_rot).astype("float32"), v_hat

    @dataclass(frozen=True)
    class QueryAutoRotation(Method):
        """Keys rotated or not per KV head, whichever gives the smaller attention-score error
        ``sum (q . (k_hat - k))^2`` over the queries of the tile's own positions (what an
        engine has when it stores the tile): per tile (``autorot_q_tile``), or once per head
        from the first stored tile and then for all its tiles (``autorot_q_seq``).
        ``autorot_q_last``: per tile, from the queries of the tile's last position only (what
        a decode step that completes the tile holds). ``autorot_qe_last`` / ``autorot_qe_tile``:
        the same with ``kvarn_math.tile.choose_key_frames``'s estimate instead of the exact
        error (what the served store computes)."""

        name: str = f"{args.preset}+autorot_q_tile"
        per_tile: bool = True
        last_only: bool = False
        estimate: bool = False
        reads_queries: bool = True

        def bytes_per_token_per_head(self, head_dim: int) -> float:
            return plain.bytes_per_token_per_head(head_dim)

        def roundtrip(self, k, v, queries=None):  # type: ignore[no-untyped-def]
            import numpy as np

            k = np.asarray(k, dtype=np.float32)
            k_rot, v_hat = plain.roundtrip(k, v)
            if queries is None:  # no queries for these positions: the preset's own frame
                return k_rot, v_hat
            from kvarn_math.tile import key_frame_errors

            k_raw = unrotate(plain.roundtrip(rotate(k).astype("float32"), v)[0])
            g = plain.group_size
            t, h, d = k.shape
            # per tile and KV head: its G keys, and the queries of its G positions in the head's
            # query group ([tiles, heads, G * group, D])
            k_tiles = k.reshape(t // g, g, h, d).transpose(0, 2, 1, 3)
            q = np.asarray(queries, dtype=np.float32).reshape(t // g, g, h, -1, d)
            if self.last_only:
                q = q[:, -1:]
            q_tiles = q.transpose(0, 2, 1, 3, 4).reshape(t // g, h, -1, d)
            if self.estimate:
                from kvarn_math.tile import key_frame_estimates

                err_rot, err_raw = key_frame_estimates(k_tiles, q_tiles)
            else:
                err_rot, err_raw = key_frame_errors(
                    k_tiles, q_tiles, plain.preset, iterations=plain.iterations
                )
            raw = err_raw < err_rot  # [tiles, heads]
            if not self.per_tile:
                raw = np.broadcast_to(raw[:1], raw.shape)
            pick = np.repeat(raw, g, axis=0)[:, :, None]
            return np.where(pick, k_raw, k_rot).astype("float32"), v_hat

    @dataclass(frozen=True)
    class OtherBits(KVarN):
        """KVarN with other key / value bit widths at the preset's tile (``kXvY``), e.g. k3v3,
        which has exactly k4v2's bytes (3 + 3 = 4 + 2 bits, the same scales)."""

        key_bits: int = 4
        value_bits: int = 2

        @property
        def preset(self) -> Preset:
            return Preset.from_bits(self.key_bits, self.value_bits, self.group_size)

    @dataclass(frozen=True)
    class Refit(Method):
        """The plain preset with each row's step and zero point refitted by least squares to
        its codes, and the codes re-rounded to the refitted grid, ``iters`` times (``refitN``;
        ``refitN_v``: values only). The same bytes; only the store's arithmetic changes."""

        name: str = f"{args.preset}+refit1"
        iters: int = 1
        keys: bool = True

        def bytes_per_token_per_head(self, head_dim: int) -> float:
            return plain.bytes_per_token_per_head(head_dim)

        def roundtrip(self, k, v):  # type: ignore[no-untyped-def]
            import kvarn_math.tile as tile_mod

            original = tile_mod.quantize_rows
            iters = self.iters

            def refit_rows(x, bits, clip_ratios=()):  # type: ignore[no-untyped-def]
                return refit(original(x, bits, clip_ratios), x, iters)

            tile_mod.quantize_rows = refit_rows
            try:
                k_r, v_r = plain.roundtrip(k, v)
            finally:
                tile_mod.quantize_rows = original
            return (k_r if self.keys else plain.roundtrip(k, v)[0]), v_r

    variants: list[Method] = []
    recent: list[int] = []
    for name in filter(None, (v.strip() for v in args.variants.split(","))):
        if re.fullmatch(r"recent[1-9]", name):
            recent.append(int(name[6:]))
        elif name == "clip":
            variants.append(clipped)
        elif name == "clip_v":
            variants.append(ValuesClipped())
        elif re.fullmatch(r"k[1-8]v[1-8]", name):
            kb, vb = int(name[1]), int(name[3])
            variants.append(
                OtherBits(
                    name=f"{args.preset}+{name}",
                    group_size=plain.group_size,
                    key_bits=kb,
                    value_bits=vb,
                )
            )
        elif re.fullmatch(r"refit[1-9](_v)?", name):
            variants.append(
                Refit(
                    name=f"{args.preset}+{name}", iters=int(name[5]), keys=not name.endswith("_v")
                )
            )
        elif re.fullmatch(r"iters[0-9]+", name):
            variants.append(
                KVarN(
                    name=f"{args.preset}+{name}",
                    group_size=plain.group_size,
                    iterations=int(name[5:]),
                )
            )
        elif name in ("autorot_tile", "autorot_seq"):
            variants.append(
                AutoRotation(name=f"{args.preset}+{name}", per_tile=name == "autorot_tile")
            )
        elif name in (
            "autorot_q_tile",
            "autorot_q_seq",
            "autorot_q_last",
            "autorot_qe_tile",
            "autorot_qe_last",
        ):
            variants.append(
                QueryAutoRotation(
                    name=f"{args.preset}+{name}",
                    per_tile=name != "autorot_q_seq",
                    last_only=name.endswith("_last"),
                    estimate=name.startswith("autorot_qe"),
                )
            )
        elif name in ("norot_k", "norot"):
            variants.append(NoRotation(name=f"{args.preset}+{name}", values=name == "norot"))
        elif name.startswith("signs") and name[5:].isdigit():
            variants.append(RandomSigns(name=f"{args.preset}+{name}", seed=int(name[5:])))
        else:
            parser.error(
                f"unknown variant {name!r}: expected clip, clip_v, signsN, kXvY, refitN[_v], "
                "norot_k, norot, autorot_tile, autorot_seq, autorot_q_tile, autorot_q_seq, autorot_q_last, "
                "autorot_qe_tile, autorot_qe_last, "
                "recentN or itersN"
            )

    started = time.time()
    lm = load_model(args.model)
    install(lm.model)
    text, source = find_wikitext()
    chunks = text_chunks(lm.tokenizer, text, args.chunks, args.tokens)
    methods = [*select_methods("bf16", BLOCK), plain, *variants]
    results = []
    for n in [0, *recent]:  # recentN: every method again, N more tiles exact
        result = evaluate_perplexity(
            lm.model,
            chunks,
            methods,
            head_dim=lm.head_dim,
            block_size=BLOCK,
            sink_tokens=BLOCK,
            recent_blocks=n,
            suite="wikitext",
            source=source,
        )
        results.append((f"+recent{n}" if n else "", result))
    rows: dict[str, dict] = {}
    for suffix, res in results:
        for row in res.rows:
            if row.method == "bf16":
                continue
            name = row.method + suffix
            rows[name] = {
                "delta_pct": row.delta_pct,
                "delta_se_pct": row.delta_se_pct,
                "kl": row.kl,
                "top1": row.top1,
                "chunk_nll": row.chunk_nll,
            }
            print(f"{name}: {row.delta_pct:+.2f}% ± {row.delta_se_pct:.2f}, KL {row.kl:.5f}")
    base = rows[plain.name]["chunk_nll"]
    for name, row in rows.items():
        if name != plain.name:
            row["vs_plain_pct"], row["vs_plain_se_pct"] = paired_change(row["chunk_nll"], base)
            print(
                f"{name} vs {plain.name}: {row['vs_plain_pct']:+.2f}% ± {row['vs_plain_se_pct']:.2f}"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.tag}_{args.model}.json"
    payload = {
        "command": "python packages/kvarn-eval/scripts/recipe_sweep.py "
        f"--model {args.model} --preset {args.preset} --ratios {args.ratios} "
        f"--variants {args.variants} --chunks {args.chunks} --tokens {args.tokens} "
        f"--tag {args.tag}",
        "source": source,
        "ratios": ratios,
        "variants": args.variants,
        "rows": rows,
        "seconds": time.time() - started,
    }
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path} ({payload['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
