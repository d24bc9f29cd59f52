"""Why a hybrid's kvarn block holds more tokens than bf16's, and what that costs (vLLM 0.26).

vLLM keeps one page per block id in every KV cache group, and a recurrent state takes exactly
one page (``MambaSpec``: its page is the state, padded; 0.26 has no state spread over
several blocks). A block's page therefore holds at least one state under every cache, and
tokens per block = page / bytes per token: a cache of 4.8x fewer bytes per token has 4.8x
longer blocks, or pads its pages back to bf16's tokens per block and gives the capacity up.
Between the two the only knob is how far to pad. Here vLLM's planner sizes the pages of the
real Nemotron-H-8B and Qwen3-Next-80B-A3B shapes (as in ``test_hybrid_evidence.py``) and the
costs follow from vLLM's per-request accounting (``hybrid_evidence.blocks_per_request``):

* memory per request of ``T`` tokens, kvarn against bf16, at every ``T``;
* the same for kvarn blocks padded to shorter lengths (what a smaller block would cost);
* prefix caching: hits land on block boundaries, so a hit on a shared prefix of ``P`` tokens
  recomputes ``P mod block`` (``block / 2`` on average).

    python packages/kvarn-vllm/tests/test_hybrid_tradeoff.py   # the table in docs/serving.md
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import _releases
import pytest
from test_hybrid_evidence import _script, plan

LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
KVARN = "kvarn_k4v2_g128"


def request_bytes(shape: str, block: int, page: int, mode: str, tokens: int) -> int:
    """Bytes of the pool one request of ``tokens`` tokens holds (all layers, all groups)."""
    script = _script()
    config = script.SHAPES[shape]
    blocks = script.blocks_per_request(config, block, tokens, mode)
    return blocks * page * script.layers_per_group(config)


def tradeoff(shape: str, folder: Path, prefix: bool) -> list[dict]:
    """Rows of bf16, kvarn and kvarn padded to shorter blocks: block, page, bytes per request
    at each of :data:`LENGTHS` and against bf16, mean tokens a prefix hit recomputes."""
    bf16 = plan(shape, "auto", folder, prefix=prefix)
    kvarn = plan(shape, KVARN, folder, prefix=prefix)
    rows = []
    unit = 128  # kvarn's tile (and Nemotron-H's Mamba chunk in vLLM's 'all' mode)
    padded = sorted({unit * math.ceil(bf16["block_size"] / unit), kvarn["block_size"] // 2})
    candidates = [("auto", bf16["block_size"], bf16["page_bytes"])]
    candidates += [(f"{KVARN} padded", b, kvarn["page_bytes"]) for b in padded]
    candidates += [(KVARN, kvarn["block_size"], kvarn["page_bytes"])]
    for name, block, page in candidates:
        row = {"cache": name, "block": block, "page": page, "mode": kvarn["mamba_cache_mode"]}
        row["bytes"] = {t: request_bytes(shape, block, page, row["mode"], t) for t in LENGTHS}
        rows.append(row)
    for row in rows:
        row["vs_bf16"] = {t: row["bytes"][t] / rows[0]["bytes"][t] for t in LENGTHS}
        row["mean_recompute"] = row["block"] / 2
    return rows


@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix", "prefix"])
@pytest.mark.parametrize("shape", ["nemotron-h-8b", "qwen3-next-80b"])
def test_longer_blocks_are_the_price_of_the_saving(registered, tmp_path, shape, prefix):
    rows = tradeoff(shape, tmp_path, prefix)
    bf16, kvarn = rows[0], rows[-1]
    page_ratio = kvarn["page"] / bf16["page"]
    # Both pages are one state rounded up: to whole tiles, or (bf16 in vLLM's 'all' mode) to
    # Mamba chunks of 128 tokens, which leaves Nemotron-H's bf16 page 8% above its state.
    assert 0.9 < page_ratio < 1.03
    for t in LENGTHS:
        # A request never holds more blocks than under bf16; up to one bf16 block it holds
        # as many (one attention block per group plus its states): no gain, the page's
        # rounding as the only difference.
        blocks_kvarn = kvarn["bytes"][t] / kvarn["page"]
        blocks_bf16 = bf16["bytes"][t] / bf16["page"]
        assert blocks_kvarn <= blocks_bf16
        if t <= bf16["block"]:
            assert kvarn["vs_bf16"][t] == pytest.approx(page_ratio)
    # Long requests gain, and the gain shrinks with every shorter (padded) block: at 32K the
    # memory per request falls monotonically as the block grows.
    at_32k = [r["vs_bf16"][32768] for r in rows]
    assert at_32k == sorted(at_32k, reverse=True) and at_32k[-1] < 0.7
    # A block padded down to bf16's length (in whole tiles) saves only what its rounding up
    # to tiles and its page's rounding give: the compression is gone.
    same = rows[1]
    assert same["block"] < bf16["block"] + 128
    rounding = bf16["block"] / same["block"] * page_ratio
    assert all(same["vs_bf16"][t] >= 0.97 * rounding for t in LENGTHS)
    # Prefix hits: kvarn's block, and so the tokens a hit recomputes, are 3.6-7x bf16's.
    assert 3 < kvarn["block"] / bf16["block"] < 8


def main() -> None:
    """Print the trade-off tables (markdown) for docs/serving.md#hybrid-models."""
    import tempfile

    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    import kvarn_vllm

    kvarn_vllm.register()
    shown = (1024, 4096, 8192, 32768)
    for shape in ("nemotron-h-8b", "qwen3-next-80b"):
        for prefix in (False, True):
            with tempfile.TemporaryDirectory() as folder:
                rows = tradeoff(shape, Path(folder), prefix)
            print(f"\n{shape}, prefix caching {'on' if prefix else 'off'} ({rows[-1]['mode']})\n")
            head = " | ".join(f"{t // 1024}K" for t in shown)
            print(f"| cache | block | page | MiB per request at {head} | mean recompute |")
            print("| --- | ---: | ---: |" + " ---: |" * len(shown) + " ---: |")
            for r in rows:
                cells = " | ".join(
                    f"{r['bytes'][t] / 2**20:,.0f} ({r['vs_bf16'][t]:.2f})" for t in shown
                )
                print(
                    f"| {r['cache']} | {r['block']:,} | {r['page']:,} | {cells} | "
                    f"{r['mean_recompute']:,.0f} |"
                )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()


# vLLM 0.26/0.27's planner (test_hybrid_evidence.plan), where kvarn's spec patch applies
pytestmark = [_releases.needs("hybrid-block-size"), _releases.needs("kv-cache-spec")]
