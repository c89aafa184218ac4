import sys

from yaie.cli import main

sys.exit(main())
