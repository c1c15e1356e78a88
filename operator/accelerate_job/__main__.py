"""`python -m accelerate_job`: the `accelerate-job` CLI."""

import sys

from .cli import main

sys.exit(main())
