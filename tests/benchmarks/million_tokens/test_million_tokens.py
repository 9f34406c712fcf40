"""benchmarks/million_tokens/million_tokens.py: its sizes fit two 80 GB H100s at a million tokens, and a
two-rank run on the CPU (host backend, gloo) fills a request chunk by chunk, decodes it and
reports the page traffic (no timings are asserted)."""

import json
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[3]
million_tokens = pytest.importorskip("benchmarks.million_tokens.million_tokens")

from lab.serving.model import SHAPES  # noqa: E402


def test_a_million_tokens_of_llama3_8b_fit_two_h100s_beside_the_sharded_weights():
    args = million_tokens.parse_args(["--device", "cuda"])
    assert (args.tokens, args.model, args.ranks, args.large_page_mib) == (1 << 20, "llama3-8b", 2, 128)
    shape = SHAPES["llama3-8b"]
    half = million_tokens.rank_shape(shape, 2)
    assert (half.num_heads, half.num_kv_heads, half.head_dim) == (16, 4, 128)  # what each rank's kernels plan for
    context = million_tokens.max_context(args)
    assert context >= args.tokens + args.warmup + args.decode_tokens and context % 2048 == 0
    budget = million_tokens.kv_budget(half, torch.bfloat16, context, 128 << 20, 2 << 20)
    assert 64 << 30 <= budget <= (64 << 30) + (512 << 20)  # 64 KiB a token a rank
    weights = million_tokens.weight_bytes(shape, torch.bfloat16, 2)
    assert 8 << 30 < weights < 9 << 30  # half the layers' weights, the embedding and LM head whole
    assert weights + budget + million_tokens.HEADROOM_BYTES <= 78 << 30


def test_the_fp32_reference_is_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(8, 16), torch.randn(1000, 2, 16), torch.randn(1000, 2, 16)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.view(8, 1, 16), k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True).view(8, 16)
    million_tokens.REFERENCE_CHUNK, chunk = 300, million_tokens.REFERENCE_CHUNK
    try:
        assert torch.allclose(million_tokens.reference_attention(q, k, v), expected, atol=1e-5)
    finally:
        million_tokens.REFERENCE_CHUNK = chunk


def test_two_ranks_on_the_cpu_fill_decode_and_report_the_page_traffic(tmp_path):
    tokens, chunk = 16384, 4096
    subprocess.run([sys.executable, "-m", "benchmarks.million_tokens.million_tokens", "--device", "cpu", "--tokens",
                    str(tokens), "--chunk", str(chunk), "--decode-tokens", "2", "--warmup", "1", "--out", str(tmp_path)],
                   check=True, cwd=ROOT, timeout=300)  # where -m finds benchmarks
    results = json.loads((tmp_path / "million_tokens_cpu.json").read_text())
    assert results["mode"] == "model" and results["provenance"]["git_commit"]
    assert [r["rank"] for r in results["ranks"]] == [0, 1]
    for rank in results["ranks"]:
        fill, decode = rank["fill"], rank["decode_run"]
        assert rank["kv_heads"] == 1 and rank["agreement"] == "shared_memory"
        assert fill["chunks"] == tokens // chunk and fill["pages_expected_left"] == 0
        mapped = fill["traffic"]["step"]["units"] + fill["traffic"]["mapped_ahead"]["units"]
        assert mapped * rank["page_bytes"] >= fill["kv_bytes"] > 0
        assert fill["traffic"]["bytes_mapped"] >= fill["kv_bytes"]
        assert decode["context_end"] == tokens + 3 and decode["tok_s"] > 0
        assert rank["check"]["rel_err_vs_fp32"] < 1e-4
