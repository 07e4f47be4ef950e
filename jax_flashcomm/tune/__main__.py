"""``python -m jax_flashcomm.tune``: measure this machine and write its tuning table."""

import sys

from jax_flashcomm.tune._measure import main

sys.exit(main())
