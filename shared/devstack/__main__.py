"""``python -m shared.devstack`` (``make up``): the embedded stack in the foreground."""

from shared.devstack.embedded import main

raise SystemExit(main())
