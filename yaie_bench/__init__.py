"""Tools that measure yaie from outside the library: a load generator for any OpenAI-compatible
server on loopback (yaie, vLLM, llama.cpp's llama-server), a launcher of `yaie serve` for a
load test, and the fitter of the step-time cost model `yaie simulate` runs on.

- prompts.py: the deterministic prompt sets;
- load_generator.py: streaming requests at concurrency levels, timed;
- results.py: what a level measured (TTFT, TPOT, latency percentiles, errors);
- counters.py: a server's counters from its /metrics (speculative acceptance, step sums);
- report.py: the results table; cli.py: the command line (`python -m yaie_bench`);
- launcher.py: `yaie serve` on a free loopback port, for as long as a test runs;
- cost_fit.py: `yaie bench --fit-cost-model`.

The library never imports this package; `yaie bench` imports it when run.
"""
