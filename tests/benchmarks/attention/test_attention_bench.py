"""benchmarks/attention/attention_bench.py on the CPU: its grid, its arguments, and FlashInfer's
kernels skipped with a reason where FlashInfer cannot run (no timings are asserted)."""

import pytest

attention_bench = pytest.importorskip("benchmarks.attention.attention_bench")


def test_decode_grid_stops_at_the_token_cap():
    shapes = attention_bench.decode_shapes((1, 4, 16, 64), (4096, 16384, 65536), 1 << 20)
    assert (64, 16384) in shapes and (16, 65536) in shapes
    assert (64, 65536) not in shapes  # 4M tokens: 16 GiB of K/V per storage
    assert all(b * c <= 1 << 20 for b, c in shapes)


def test_arguments_default_to_both_models_and_quick_to_one():
    args = attention_bench.parse_args(["--device", "cpu"])
    assert args.models == ["llama3-8b", "yi-34b"] and args.only == ["decode", "prefill", "append"]
    assert args.flex == "eager"  # compiling Flex on a CPU is slower than the smoke test
    assert attention_bench.parse_args(["--device", "cpu", "--quick"]).models == ["llama3-8b"]
    yi = attention_bench.MODELS["yi-34b"]
    assert (yi.query_heads // yi.kv_heads, yi.layers) == (7, 60)


def test_the_interleaved_cache_drops_layers_to_fit_its_budget():
    llama = attention_bench.MODELS["llama3-8b"]
    assert attention_bench.interleaved_layers(llama, 1 << 20, 40 << 30) == 8  # 4 KiB x 32 layers x 1M = 128 GiB
    assert attention_bench.interleaved_layers(llama, 4096, 40 << 30) == 32


def test_a_cpu_run_measures_vkv_and_flex_and_skips_flashinfer_with_its_reason(tmp_path):
    args = attention_bench.parse_args(["--device", "cpu", "--quick", "--rounds", "1", "--target-ms", "0.1",
                                       "--out", str(tmp_path)])
    flashinfer = attention_bench.FlashInfer("cpu")
    assert flashinfer.module is None and flashinfer.version == "skipped: FlashInfer runs on CUDA only"
    results = {"rows": []}
    run = attention_bench.AttentionRun(args, [attention_bench.MODELS["llama3-8b"]],
                                       attention_bench.flex_attention, flashinfer, results, str(tmp_path / "r.json"))
    run.shape(run.models[0], "decode", 2, 128, 1, 127, "decode")
    storages = {row["storage"] for row in results["rows"]}
    assert storages == {"plain", "vkv_per_layer", "vkv_interleaved", "flex_paged_16", "flex_paged_128"}
    assert not [row for row in results["rows"] if "error" in row]
    assert all(row["rel_err"] < 1e-2 for row in results["rows"])
    assert all(row["bitwise_equal_plain"] for row in results["rows"] if row["storage"].startswith("vkv"))


def test_the_decode_summary_puts_the_serving_kernel_and_each_layout_beside_flashinfer_paged():
    from benchmarks.attention.attention_summary import decode_summary, decode_table

    cell = dict(model="llama3-8b", phase="decode", batch=16, context=16384)
    rows = [dict(cell, storage="flashinfer_paged_128", kernel="flashinfer_decode_tc", page_tokens=128, ms=1.0),
            dict(cell, storage="flashinfer_paged_16", kernel="flashinfer_decode", page_tokens=16, ms=1.2),
            dict(cell, storage="vkv_interleaved", kernel="sdpa_default", ms=0.98),
            dict(cell, storage="vkv_interleaved", kernel="flash_varlen", ms=1.25),
            dict(cell, storage="vkv_interleaved", kernel="flashinfer_decode_tc_128_token_pages", ms=1.1),
            dict(cell, storage="vkv_interleaved", kernel="flashinfer_decode_one_page", error="failed"),
            dict(cell, storage="vkv_per_layer", kernel="flashinfer_decode_128_token_pages", ms=0.97),
            dict(cell, storage="plain", kernel="flash_varlen", ms=0.5)]
    (entry,) = decode_summary(rows)
    assert entry["flashinfer_paged"] == {"kernel": "flashinfer_decode_tc", "ms": 1.0, "page_tokens": 128}
    assert entry["serving_kernel"]["kernel"] == "flash_varlen" and entry["serving_kernel"]["vs_paged"] == 0.8
    assert entry["dense_kernel"]["kernel"] == "sdpa_default"
    assert entry["flashinfer_on_vkv_interleaved"]["ms"] == 1.1  # the default layout, not the faster per-layer
    assert entry["flashinfer_on_vkv_per_layer"]["ms"] == 0.97
    table = decode_table([entry])
    assert "| llama3-8b | 16 | 16K | flashinfer_decode_tc, 128-token pages | 1.000 | 1.250 | 0.80x |" in table
    assert "FlashInfer decode on vkv interleaved (default): 0.91-0.91x over 1 cells" in table
    assert "A serving engine runs flash_varlen" in table


def test_the_attention_bench_takes_cells_and_names_its_one_page_kernels():
    args = attention_bench.parse_args(["--device", "cpu", "--cells", "1x65536", "64x16384"])
    assert args.cells == [(1, 65536), (64, 16384)]
    with pytest.raises(SystemExit):
        attention_bench.parse_args(["--device", "cpu", "--cells", "64-16384"])
    assert attention_bench.SLOT_DECODE_KERNELS["flashinfer_decode_one_page"] == (0, False)
