"""``python -m dpverify`` runs the command line, as ``dpverify`` does."""

from dpverify.cli.main import main

raise SystemExit(main())
