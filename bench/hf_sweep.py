"""tpcompile's plans of every causal-LM family of the installed transformers, at a tiny config.

    nice -n 19 python -m bench.hf_sweep --numerics --jobs 2   # -> results/hf_sweep.md, .json
    python -m bench.hf_sweep --only LlamaForCausalLM GPT2LMHeadModel --numerics
    python -m bench.hf_sweep --representative --numerics   # the CI subset (REPRESENTATIVE)
    python -m bench.hf_sweep --rejudge --jobs 2   # the same plans against a changed bound
    python -m bench.hf_sweep --rejudge --only Gemma2ForCausalLM   # those families' rows only

The families and their tiny configs: bench/hf_configs.py. Each family runs in its own
subprocess with a timeout, so a hang or a crash is a row, not the end of the sweep. In it: the
unsharded model runs ``model(ids)`` (ids 2 x 16; a family that fails here is *not built*: a
config or dependency problem, not tpcompile's), then ``tpcompile.explain(model, (ids,), 2)``,
judged against Megatron's bound derived from the model (bench/hf_verdict.py: the status) and,
with ``--numerics``, the 2-rank run on gloo (bench/hf_numerics.py: logits and every gradient
against the unsharded model, ``exact`` within 1e-5, a float32 miss again in float64 within
1e-10). The report: bench/hf_report.py. Other statuses: ``not captured``, ``not built``,
``skipped``, ``timeout`` / ``crash``, ``tpcompile error`` (the planner refused) or
``tpcompile internal error`` (a pass raised something else: a bug).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from bench.hf_configs import BATCH, SEQ, build, example_ids, families, first_line, get
from bench.hf_numerics import NUMERICS_TIMEOUT_S, WORLD_SIZE, run_numerics
from bench.hf_report import merge_rows, numerics_cell, report_markdown
from bench.hf_verdict import plan_row

__all__ = ["REPRESENTATIVE", "build", "example_ids", "measure", "plan_row"]

RESULTS = Path(__file__).resolve().parent / "results"
TIMEOUT_S = 120

# At Megatron's bound derived from the model and exact on 2 gloo ranks, chosen to cover the
# distinct ways of writing a decoder block; for CI (`--representative`). Bloom (custom
# autograd.Function, not captured) is not here.
REPRESENTATIVE: tuple[str, ...] = (
    "LlamaForCausalLM",      # SwiGLU, RoPE, GQA 4q/2kv: KV heads sharded with their queries
    "MistralForCausalLM",    # llama-like with a sliding window
    "Qwen2ForCausalLM",      # q/k/v biases
    "Qwen3ForCausalLM",      # per-head q/k RMSNorm: their weights' gradients ride in the input's sync
    "GemmaForCausalLM",      # GeGLU, norm as x * (1 + w), scaled embeddings
    "Gemma2ForCausalLM",     # logit soft-capping, sandwich norms, alternating sliding window
    "GPT2LMHeadModel",       # transposed Conv1D, fused c_attn split three ways
    "GPTNeoXForCausalLM",    # fused QKV viewed per head, partial rotary, parallel residual
    "PhiForCausalLM",        # parallel attention + MLP (2/1), partial rotary, biases
    "GPTJForCausalLM",       # parallel block, interleaved rotary, no biases on q/k/v
    "CodeGenForCausalLM",    # fused qkv in mp_num groups, parallel block
    "OPTForCausalLM",        # learned positions, ReLU MLP with biases
    "MptForCausalLM",        # ALiBi, fused Wqkv (the Bloom-style block that captures)
    "Olmo2ForCausalLM",      # RMSNorm over whole q/k projections: its statistic all-reduced
    "BitNetForCausalLM",     # norms over attention's heads before o_proj and over the MLP's hidden
    "DeepseekV3ForCausalLM",  # MLA (q_a / kv_a whole, q_b / kv_b column) and MoE experts
    "ElectraForCausalLM",    # post-LN, embeddings projected: layer 0's input all-reduced outside it
    "BambaForCausalLM",      # Mamba-2 with one B / C group: those rows of in_proj whole, gated norm
    "Qwen3_5ForCausalLM",    # gated delta rule: its in-place forward substitution made out of place
    "FalconForCausalLM",     # MQA: the kv head picked from the fused qkv by list indices
    "GptOssForCausalLM",     # interleaved gate/up by strided slices, per-expert biases by index
    "CohereForCausalLM",     # parallel block, residual first: its sum carried, reduced once (1/1)
)

# Families that are not text-only causal LMs over token ids, or need something not installed.
SKIP = {
    "BltForCausalLM": "byte latent transformer: four sub-models (patcher, local encoder and "
                      "decoder, global) and hash n-gram embeddings of 500,002 rows x 6 groups "
                      "that the standard fields do not shrink (5 GB at 'tiny', over the timeout); "
                      "needs a config of its own",
}


def measure(name: str, numerics: bool, mode: str = "train") -> dict:
    """One family's row; a family whose train mode runs a custom autograd.Function (which
    torch.export cannot capture) is measured again in eval mode, both reasons kept."""
    row = _measure(name, numerics, mode)
    if mode == "train" and row["status"] == "not captured" and "autograd.Function" in row["why"]:
        again = _measure(name, numerics, "eval")
        if again["status"] != "not captured":
            row = {**again, "train_mode": row["why"]}
    return row


def _measure(name: str, numerics: bool, mode: str) -> dict:
    import torch

    row: dict = {"family": name, "mode": mode}
    try:
        model = build(name, mode)
        ids = example_ids()
        with torch.no_grad():
            model(ids)
    except Exception as e:  # noqa: BLE001 - a family that does not run unsharded
        return {**row, "status": "not built", "why": first_line(e),
                "trace": traceback.format_exc()[-3000:]}
    cfg = model.config
    row["config"] = {k: get(cfg, k) for k in ("hidden_size", "num_hidden_layers",
                                                  "num_attention_heads", "num_key_value_heads",
                                                  "intermediate_size", "vocab_size",
                                                  "tie_word_embeddings")
                     if isinstance(get(cfg, k), (int, bool))}
    row["n_params"] = sum(p.numel() for p in model.parameters())
    row = plan_row(row, model, (ids,), cfg, WORLD_SIZE)
    if numerics and "per_layer" in row:
        del model  # the ranks build their own: Phi-4-multimodal's unshrunk encoders
        gc.collect()  # (870M parameters) ran out of memory with a third copy held here
        row["numerics"] = run_numerics(name, mode)
        row["exact"] = row["numerics"].get("exact", False)
    return row



def run_one_subprocess(name: str, numerics: bool, module: str = "bench.hf_sweep") -> dict:
    """``python -m module --one name``'s row, in a process of its own with a timeout (a
    hang or a crash is the row's status); the diffusers sweep runs its classes through it."""
    timeout = TIMEOUT_S + (NUMERICS_TIMEOUT_S if numerics else 0)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, "-m", module, "--one", name, "--out", str(out)]
        if numerics:
            cmd.append("--numerics")
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  cwd=Path(__file__).resolve().parents[1],
                                  env={**os.environ, "OMP_NUM_THREADS": "1",
                                       "TRANSFORMERS_VERBOSITY": "error"})
        except subprocess.TimeoutExpired:
            return {"family": name, "status": "timeout", "why": f"no result in {timeout} s",
                    "seconds": time.perf_counter() - start}
        if out.exists():
            return json.loads(out.read_text())
        return {"family": name, "status": "crash",
                "why": f"exit {proc.returncode}: {first_line(proc.stderr)}",
                "trace": proc.stderr[-3000:], "seconds": time.perf_counter() - start}


def _one(name: str, out: str, numerics: bool) -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    if name in SKIP:
        row = {"family": name, "status": "skipped", "why": SKIP[name]}
    else:
        row = measure(name, numerics)
    Path(out).write_text(json.dumps(row, default=str))


# what a row's numerics depend on: the plan (its collectives, placements, bytes), not the bound
PLAN_FIELDS = ("collectives", "param_bytes_max_rank", "param_bytes_total", "gathers", "fallbacks",
               "kept_replicated", "per_layer", "outside_layers")


def _rejudge(jobs: int, only: list[str] | None = None) -> None:
    """results/hf_sweep.json's families (``only`` these) planned and judged again; each row
    keeps the numerics of the run that wrote the file where every field they depend on
    (``PLAN_FIELDS``) is unchanged, and loses them otherwise."""
    from concurrent.futures import ThreadPoolExecutor

    data = json.loads((RESULTS / "hf_sweep.json").read_text())
    old = {r["family"]: r for r in data["rows"]}
    again = [name for name in old if only is None or name in only]
    fresh = dict(zip(again, ThreadPoolExecutor(max_workers=jobs).map(
        lambda name: run_one_subprocess(name, False) if name not in SKIP else old[name], again)))
    rows = [fresh.get(name, row) for name, row in old.items()]
    for row in (fresh[name] for name in again):
        was = old[row["family"]]
        row["found_by"] = was.get("found_by", "?")
        if "numerics" in was and all(row.get(k) == was.get(k) for k in PLAN_FIELDS):
            row["numerics"], row["exact"] = was["numerics"], was.get("exact", False)
    data = {**data, "rows": rows, "rejudged": time.strftime("%Y-%m-%d")}
    (RESULTS / "hf_sweep.json").write_text(json.dumps(data, indent=1, default=str))
    (RESULTS / "hf_sweep.md").write_text(report_markdown(rows, data, len(rows)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="these families (class names)")
    parser.add_argument("--representative", action="store_true", help="REPRESENTATIVE only")
    parser.add_argument("--numerics", action="store_true",
                        help="also run the families that plan on 2 gloo ranks")
    parser.add_argument("--json", metavar="PATH",
                        help="write the rows here, and a full sweep's report beside them as .md "
                             "(default: results/hf_sweep.json and .md)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="families measured at once (each in its own subprocess)")
    parser.add_argument("--merge", action="store_true",
                        help="with --only: replace those rows in results/hf_sweep.json")
    parser.add_argument("--rejudge", action="store_true",
                        help="plan every family of results/hf_sweep.json again, without "
                             "numerics, keeping a row's numerics where its plan is unchanged "
                             "(after a change to the bound or the verdict)")
    parser.add_argument("--report-only", action="store_true",
                        help="regenerate results/hf_sweep.md from results/hf_sweep.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        return _one(args.one, args.out, args.numerics)
    if args.report_only:  # regenerate the markdown from results/hf_sweep.json
        data = json.loads((RESULTS / "hf_sweep.json").read_text())
        text = report_markdown(data["rows"], data, len(data["rows"]))
        (RESULTS / "hf_sweep.md").write_text(text)
        (RESULTS / "hf_sweep.json").write_text(json.dumps(data, indent=1, default=str))
        return print(text)
    import torch
    import transformers

    found = families()
    names = args.only or (list(REPRESENTATIVE) if args.representative else list(found))
    if args.rejudge:
        return _rejudge(args.jobs, args.only)
    rows = []
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=args.jobs)
    for name, row in zip(names, pool.map(lambda n: run_one_subprocess(n, args.numerics), names)):
        row["found_by"] = found.get(name, "?")
        rows.append(row)
        print(f"[{row.get('seconds', 0):5.1f}s] {name}: {row['status']} "
              f"{row.get('why', row.get('per_layer', ''))[:150]} "
              f"{numerics_cell(row) if args.numerics else ''}", file=sys.stderr, flush=True)
    full = not args.only and not args.representative
    meta = {"torch": torch.__version__, "transformers": transformers.__version__,
            "world_size": WORLD_SIZE, "batch": BATCH, "seq": SEQ, "numerics": args.numerics}
    if args.merge:  # replace these families' rows in the full sweep's results
        old = json.loads((RESULTS / "hf_sweep.json").read_text())
        rows = merge_rows(old["rows"], rows)
        full = True
        meta = {**{k: old[k] for k in ("rejudged", "numerics") if k in old},
                **{k: v for k, v in meta.items() if k != "numerics"},
                "merged": {"date": time.strftime("%Y-%m-%d"), "families": len(names),
                           "numerics": args.numerics}}
    text = report_markdown(rows, meta, len(found) if full else len(names))
    json_path = Path(args.json) if args.json else RESULTS / "hf_sweep.json" if full else None
    if json_path:
        json_path.write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str))
    if full:
        (json_path.with_suffix(".md") if args.json else RESULTS / "hf_sweep.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
