"""Load-test any OpenAI-compatible server on loopback (yaie, vLLM, llama.cpp's llama-server).

The load generator lives in the `yaie_bench` package so that `yaie bench` can use it too; this
script is its command line (as is `python -m yaie_bench`):

    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8080 --concurrency 1,8,32 \\
        --num-requests 64 --prompt-set short --max-tokens 128 --ignore-eos --label llama.cpp
"""

import sys

from yaie_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
