"""``python -m moco_retrieval ...`` is ``moco ...`` (and ``torchrun ... -m moco_retrieval train ...``)."""

from moco_retrieval.app.cli import main

raise SystemExit(main())
