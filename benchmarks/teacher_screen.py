"""Could extraction's teacher check run its full-vocabulary head in bf16 and stay exact?

The check (eaglet.target.states.TeacherHead) multiplies every answer row's final state by
the target's lm_head in the head's dtype: float32 for the CPU demo, 576 x 49,152
multiply-adds a row, most of eaglet's CPU time beside the capture server. A bf16 product runs
at about twice the speed on a CPU with AVX512-BF16; it would keep the stored argmax exact
only where a rigorous bound on its error proves the fp32 argmax, and would recompute the
rest in fp32. This measures, on the target's own final states over real sequences:

* one core's seconds per 1,024 rows: the fp32 product, the bf16 product, and the
  reductions the check needs (argmax, log-sum-exp);
* the bf16 logits' error against fp32, the top-two margins, and the share of rows whose
  argmax no bound proves (the rows a screen would recompute): with Cauchy-Schwarz
  (||h|| max ||w||, cheap), per dimension (|h| . max |w|, cheap) and per entry (|h| |W|^T,
  a second product, as costly as the one it would save);
* how often the bf16 argmax is the fp32 one.

    .venv/bin/python benchmarks/teacher_screen.py --target results/target \\
        --data results/synthetic/train.jsonl [--samples 40]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from eaglet.core.io import read_jsonl

U16, U32 = 2.0**-8, 2.0**-24  # unit roundoff of bf16 (8 significant bits) and fp32


def seconds(fn, repeats: int = 3) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--samples", type=int, default=40)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    finals = []
    with torch.inference_mode():
        for record in read_jsonl(args.data)[: args.samples]:
            ids = torch.tensor([record["prompt_token_ids"] + record["completion_token_ids"]])
            finals.append(model(ids[:, :1024], output_hidden_states=True).hidden_states[-1][0])
        h = torch.cat(finals)
        w = model.get_output_embeddings().weight.detach().float()
        rows, (vocab, width) = h.shape[0], w.shape

        chunk, wb = h[:1024].contiguous(), w.bfloat16()
        chunk_b = chunk.bfloat16()
        logits = torch.empty(chunk.shape[0], vocab)
        logits_b = torch.empty(chunk.shape[0], vocab, dtype=torch.bfloat16)
        timing = {
            "fp32 product": seconds(lambda: torch.matmul(chunk, w.T, out=logits)),
            "bf16 product": seconds(lambda: torch.matmul(chunk_b, wb.T, out=logits_b)),
            "fp32 argmax": seconds(lambda: logits.argmax(-1)),
            "fp32 log-sum-exp": seconds(lambda: torch.logsumexp(logits, -1)),
            "bf16 max": seconds(lambda: logits_b.max(-1)),
            "bf16 log-sum-exp": seconds(lambda: torch.logsumexp(logits_b, -1)),
        }

        exact = h @ w.T
        screened = (h.bfloat16() @ wb.T).float()
        error = (screened - exact).abs().max(-1).values
        top2 = exact.topk(2).values
        margin = top2[:, 0] - top2[:, 1]
        c = 2 * U16 + U16**2 + 3 * width * U32  # input rounding + both accumulations
        top = exact.max(-1).values.abs()
        bounds = {
            "Cauchy-Schwarz": c * h.norm(dim=1) * w.norm(dim=1).max(),
            "per dimension": c * (h.abs() @ w.abs().max(0).values),
            "per entry (a second product)": c * (h.abs() @ w.abs().T).max(-1).values,
        }
        ambiguous = {
            name: float((margin < 2 * b + 2 * U16 * top).float().mean())
            for name, b in bounds.items()
        }
    result = {
        "rows": rows,
        "vocab": vocab,
        "hidden": width,
        "seconds_per_1024_rows_one_core": {k: [round(x, 3) for x in v] for k, v in timing.items()},
        "final_state_norm_median": float(h.norm(dim=1).median()),
        "head_row_norm_max": float(w.norm(dim=1).max()),
        "bf16_logit_error_row_max": {"median": float(error.median()), "max": float(error.max())},
        "top_two_margin_quantiles": dict(
            zip(("10%", "25%", "50%"), margin.quantile(torch.tensor([0.1, 0.25, 0.5])).tolist())
        ),
        "rows_no_bound_proves": ambiguous,
        "bf16_argmax_is_fp32_argmax": float(
            (screened.argmax(-1) == exact.argmax(-1)).float().mean()
        ),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
