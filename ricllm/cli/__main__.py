"""``python -m ricllm.cli``: the same command line as the ``ricllm`` script."""

import sys

from ricllm.cli import main

sys.exit(main())
