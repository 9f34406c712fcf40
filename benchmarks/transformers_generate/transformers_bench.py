"""transformers generate() with vkv's VkvCache vs DynamicCache and StaticCache.

A Llama-3-8B-shaped model (hidden 4096, 32 query / 8 KV heads of 128, vocab 128256) with
few layers and seeded random weights, in bf16; left-padded batches of prompts of 256-512
tokens (--quick: a tiny model, short prompts). For each batch size: greedy tokens/s of
generate() with each cache (eager: StaticCache is not compiled, as VkvCache is not), and
the fraction of generated tokens identical to a separate DynamicCache run (the dynamic
row compares DynamicCache with itself: the GPU's run-to-run noise floor), where rows first
diverge and how close DynamicCache's top-2 logits were there, and, teacher-forced with
DynamicCache's tokens, the fraction of steps whose logits are bitwise identical.
--deterministic makes runs bitwise reproducible (torch deterministic algorithms, a fixed
cuBLAS workspace), so that any remaining difference is the cache's.

  python -m benchmarks.transformers_generate.transformers_bench [--device cuda] [--layers 4] [--batches 1 8 32] [--deterministic]
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from benchmarks.common import argument_parser, device_tag, machine, progress, progress_bar, write_json


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if args.quick:
        config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=args.layers,
                             num_attention_heads=8, num_key_value_heads=2, pad_token_id=0)
    else:  # Llama-3-8B's layer shape
        config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8,
                             head_dim=128, max_position_embeddings=8192, rope_theta=500000.0, pad_token_id=0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with torch.device(args.device):  # random initialization on the GPU: seconds, not a minute
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # every row generates max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def prompts(batch, low, high, vocab, device, seed):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (batch,), generator=generator)
    ids = torch.randint(1, vocab, (batch, high), generator=generator)
    mask = (torch.arange(high).unsqueeze(0) >= high - lengths.unsqueeze(1)).long()  # left padding
    ids[mask == 0] = 0
    return ids.to(device), mask.to(device)


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_generate(model, ids, mask, new_tokens, cache_kind, args, scores=False):
    from vkv.integrations.transformers import VkvCache

    options = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    if scores:  # the reference's top-2 logits per step: how close a divergence was to a tie
        options.update(output_scores=True, return_dict_in_generate=True)
    cache = None
    # Both preallocated caches are built (and their memory allocated) before the timer starts.
    if cache_kind == "static":
        from transformers import StaticCache

        config = model.config
        static = StaticCache(config=config, max_cache_len=ids.shape[1] + new_tokens)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        static.early_initialization(ids.shape[0], config.num_key_value_heads, head_dim, model.dtype, ids.device)
        options.update(past_key_values=static, disable_compile=True)
    elif cache_kind.startswith("vkv"):
        layout = cache_kind.split("_", 1)[1]
        cache = VkvCache.from_model(model, max_batch_size=ids.shape[0], max_context_len=ids.shape[1] + new_tokens,
                                    layout=layout)
        options.update(cache.as_kwargs(model))
    synchronize(args.device)
    start = time.perf_counter()
    with torch.no_grad():
        tokens = model.generate(ids, **options)
    synchronize(args.device)
    seconds = time.perf_counter() - start
    extra = {}
    if scores:
        extra["top2"] = torch.stack([step.float().topk(2).values for step in tokens.scores], dim=1).cpu()
        tokens = tokens.sequences
    if cache is not None:
        stats = cache.kv_cache.stats()
        extra = {"vkv_bytes_mapped": stats["bytes_mapped"], "vkv_bytes_in_use": stats["bytes_in_use"],
                 "copies_history": cache.copies_history}
        cache.close()
    return tokens[:, ids.shape[1]:], seconds, extra


def teacher_forced_logits(model, ids, mask, forced, cache):
    """Last-position logits of a prefill and of decode steps fed `forced` (DynamicCache's tokens),
    so that one different pick does not make every later step differ."""
    from vkv.integrations.transformers import cache_kwarg

    logits, passed = [], {cache_kwarg(model): cache}  # "cache" from transformers 5.24 on
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                    **passed, use_cache=True, logits_to_keep=1)
        logits.append(out.logits[:, -1].float())
        for step in range(forced.shape[1] - 1):
            token = forced[:, step:step + 1]
            mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
            out = model(input_ids=token, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                        **passed, use_cache=True, logits_to_keep=1)
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits, dim=1)


def compare_logits(model, ids, mask, forced, kind):
    """Teacher-forced: the fraction of (row, step) logit vectors bitwise equal to DynamicCache's, and the largest difference."""
    from transformers import DynamicCache
    from vkv.integrations.transformers import VkvCache

    reference = teacher_forced_logits(model, ids, mask, forced, DynamicCache(config=model.config))
    if kind == "dynamic":  # DynamicCache against itself: what the GPU's own run-to-run differences are
        logits = teacher_forced_logits(model, ids, mask, forced, DynamicCache(config=model.config))
    else:
        cache = VkvCache.from_model(model, max_batch_size=ids.shape[0],
                                    max_context_len=ids.shape[1] + forced.shape[1], layout=kind.split("_", 1)[1])
        logits = teacher_forced_logits(model, ids, mask, forced, cache)
        cache.close()
    equal = (logits == reference).all(dim=-1)
    return {"teacher_forced_logits_identical": float(equal.float().mean()),
            "teacher_forced_max_abs_diff": float((logits - reference).abs().max()),
            "teacher_forced_first_unequal_step": int((~equal).any(0).nonzero()[0]) if not equal.all() else None}


def main():
    parser = argument_parser(__doc__, ["generate"])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (Llama-3-8B has 32)")
    parser.add_argument("--batches", type=int, nargs="*", help="batch sizes (default: 1 8 32)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cache and batch size (median)")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms and a fixed cuBLAS workspace: bitwise-reproducible "
                             "runs, so that token differences are the caches' (slower)")
    args = parser.parse_args()
    if args.deterministic:  # before the first cuBLAS handle is made
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
    batches = args.batches or ((1, 4) if args.quick else (1, 8, 32))
    low, high = (16, 32) if args.quick else (256, 512)
    new_tokens = 16 if args.quick else args.new_tokens
    kinds = ["dynamic", "static", "vkv_interleaved", "vkv_per_layer"]

    model = build_model(args)
    progress(f"model: {args.layers} layers, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, "
             f"{model.dtype} on {args.device}")
    rows = []
    cases = [(batch, kind) for batch in batches for kind in kinds]
    reference = {}
    for batch, kind in progress_bar(cases, "generate"):
        ids, mask = prompts(batch, low, high, model.config.vocab_size, args.device, seed=batch)
        run_generate(model, ids, mask, 4, kind, args)  # warm-up: kernels, allocator, vkv pages
        times, tokens, extra = [], None, {}
        for _ in range(args.repeats):
            tokens, seconds, extra = run_generate(model, ids, mask, new_tokens, kind, args)
            times.append(seconds)
        seconds = float(np.median(times))
        if kind == "dynamic":  # the reference is a separate DynamicCache run: the dynamic row is the noise floor
            reference[batch] = run_generate(model, ids, mask, new_tokens, kind, args, scores=True)
        reference_tokens, _, reference_extra = reference[batch]
        same = (tokens == reference_tokens).cpu()
        divergences = [int((~r).nonzero()[0]) if not r.all() else None for r in same]
        margins = reference_extra["top2"][..., 0] - reference_extra["top2"][..., 1]
        row = {"batch": batch, "cache": kind, "new_tokens": new_tokens, "prompt_tokens": [low, high],
               "seconds": seconds, "seconds_all": times, "tokens_per_s": batch * new_tokens / seconds,
               "identical_fraction": float(same.float().mean()),
               "rows_identical": int(same.all(dim=1).sum()),
               "first_divergence": divergences,
               # DynamicCache's top-1 minus top-2 logit where a row first diverged (0 = an exact tie)
               "margin_at_divergence": [None if p is None else float(margins[r, p]) for r, p in enumerate(divergences)],
               "median_margin": float(margins.median()), **extra}
        if kind != "static":
            row.update(compare_logits(model, ids, mask, reference_tokens, kind))
        if args.device == "cuda":
            row["torch_peak_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        rows.append(row)
        progress(f"B={batch} {kind:<16} {row['tokens_per_s']:9.1f} tok/s  identical to DynamicCache: "
                 f"{100 * row['identical_fraction']:.1f}% ({row['rows_identical']}/{batch} rows), margins where rows "
                 f"diverged {[m for m in row['margin_at_divergence'] if m is not None][:4]} (median "
                 f"{row['median_margin']:.3g}); teacher-forced logits identical "
                 f"{row.get('teacher_forced_logits_identical', float('nan')):.3f}, "
                 f"max diff {row.get('teacher_forced_max_abs_diff', float('nan')):.3g}")
    for batch in batches:
        base = next(r for r in rows if r["batch"] == batch and r["cache"] == "dynamic")["tokens_per_s"]
        for row in rows:
            if row["batch"] == batch:
                row["speed_vs_dynamic"] = row["tokens_per_s"] / base
    import transformers

    results = {"machine": {**machine(args.device), "transformers": transformers.__version__,
                           "deterministic": args.deterministic},
               "model": {"layers": args.layers, "shape": "tiny" if args.quick else "llama-3-8b", "dtype": str(model.dtype)},
               "rows": rows}
    path = os.path.join(args.out, f"transformers_{device_tag(args.device)}{'_quick' if args.quick else ''}.json")
    write_json(results, path)
    plot(results, path.replace(".json", ".png"))


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib not installed: no plot")
        return
    rows = results["rows"]
    batches = sorted({r["batch"] for r in rows})
    kinds = list(dict.fromkeys(r["cache"] for r in rows))
    figure, axis = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        values = [next(r["tokens_per_s"] for r in rows if r["batch"] == b and r["cache"] == kind) for b in batches]
        axis.bar(np.arange(len(batches)) + k * width, values, width, label=kind)
    axis.set_xticks(np.arange(len(batches)) + width * (len(kinds) - 1) / 2, [f"batch {b}" for b in batches])
    axis.set_ylabel("generated tokens / s")
    axis.set_title(f"transformers generate(), {results['model']['shape']} x{results['model']['layers']} layers, "
                   f"{results['machine'].get('gpu', 'cpu')}", fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    progress(f"wrote {path}")


if __name__ == "__main__":
    main()
