"""`python -m marlhf ...` is the `marlhf` command."""

from marlhf.cli import main

raise SystemExit(main())
