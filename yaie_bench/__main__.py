import sys

from yaie_bench.cli import main

sys.exit(main())
