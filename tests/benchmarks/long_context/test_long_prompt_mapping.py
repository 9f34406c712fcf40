"""benchmarks/long_context/long_prompt_mapping.py on the CPU: one prompt in chunks per configuration, step()
per chunk against the chunk's forward, the mapping and the goal table (no timings asserted)."""

import json
import pytest

long_prompt_mapping = pytest.importorskip("benchmarks.long_context.long_prompt_mapping")


def test_a_cpu_run_reports_step_per_chunk_and_the_mapping_of_each_configuration(tmp_path, capsys):
    tokens, chunk = 512, 128
    assert long_prompt_mapping.main(["--device", "cpu", "--prompt-tokens", str(tokens), "--chunk", str(chunk),
                                     "--configs", "large-pages", "unannounced", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "long_prompt_mapping_cpu.json").read_text())
    large, unannounced = results["runs"]
    assert (large["config"], large["announced"], unannounced["announced"]) == ("large-pages", True, False)
    assert large["large_page_bytes"] == 256 << 10 and unannounced["large_page_bytes"] == 0
    for run in results["runs"]:
        assert len(run["chunks"]) == tokens // chunk
        assert all(c["step_ms"] > 0 and c["forward_ms"] > 0 for c in run["chunks"])
        mapping = run["mapping"]
        mapped = (mapping["mapped_ahead_pages"] + mapping["step_pages"]) * run["page_bytes"]
        assert mapped >= tokens * 2 * 4 * 2 * 32 * 4  # the prompt's K/V: tiny's 4 layers, 2 KV heads of 32, fp32
    assert unannounced["ready_after_first_chunk"] is None and large["ready_after_first_chunk"] in (True, False)
    out = capsys.readouterr().out
    assert "| large-pages | 16 KiB in 256 KiB large |" in out and "| unannounced | 16 KiB |" in out
