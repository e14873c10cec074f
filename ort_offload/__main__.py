"""``python -m ort_offload`` runs the ``ort-offload`` command line."""

import sys

from ort_offload.cli import main

sys.exit(main())
