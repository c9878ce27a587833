"""``python -m shardsink``: the command line (same as the ``shardsink`` script)."""

from shardsink.cli.main import main

raise SystemExit(main())
