"""The verdict: does the drafter speed up serving, on the prompts users send, at the
concurrency they serve?

For each engine run (the target alone, vLLM's ``ngram`` speculation, and the trained
drafter at every ``num_speculative_tokens`` k), start vLLM once and, for every
concurrency of the sweep and every prompt set (the held-out split and the configured sets of
their own), send the prompts greedily and read the spec-decode Prometheus counters before and
after (``/metrics`` deltas). Acceptance length is ``1 + accepted/drafts``, acceptance rate
``accepted/draft_tokens``, per-position rate ``per_pos[i]/drafts``: pooled, every drafting
step of every request alike. Beside it, the acceptance length per request: the mean over
requests of each one's own ``1 + accepted/drafts``, from the counts vLLM returns with each
answer (:func:`per_request_acceptance`).

Every level is sent in ``rounds`` rounds; each speedup comes with a 95% interval from the
rounds' own speedups (:func:`speedup_interval`), and the verdict calls a speedup whose interval
holds 1.0 no measurable difference.

Every level is measured at each temperature of ``evaluate.temperature`` through the same
servers (vLLM verifies by rejection sampling above 0), and reported per temperature: a run
measured at T > 0 is named with it (``eagle3_k3_T1``). The last temperature listed is the one
served: the verdict, the k schedule and ``serve.json`` are taken there. The offline replay
checks the greedy runs exactly and the sampled ones by their expected acceptance.

From the sweep comes a batch-size schedule of k (vLLM's
``num_speculative_tokens_per_batch_size``: the best k at each measured concurrency, 0 where
speculation slows serving down), written ready to serve in ``serve.json`` and checked in one
more vLLM run at every concurrency.

The drafter runs are named and served by the method it was trained with (``train.method``,
read from its exported config.json: :func:`drafter_method`): EAGLE-3's ``eagle3_k3``,
P-EAGLE's ``peagle_k3`` served with ``"parallel_drafting": true`` (:mod:`eaglet.model.peagle`), or
DFlash's ``dflash_k3`` served with ``"method": "dflash"`` (:mod:`eaglet.model.dflash`); the last
two are replayed offline with their one forward per round.
"""
