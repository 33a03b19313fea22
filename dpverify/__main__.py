"""``python -m dpverify`` runs the command line, as ``dpverify`` does."""

from dpverify._cli import main

raise SystemExit(main())
