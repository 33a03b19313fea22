"""The ``dpverify`` command line: everything that talks to a person.

- ``main``: the subcommands and the one mapping of errors to exit codes;
- ``exits``: the exit statuses and the report of a usage error, shared with ``selftest``;
- ``user_model``: loading ``MODULE:FACTORY``, ``--inputs`` and inferring a batch;
- ``check_view``: ``check``'s progress, tables and explanations (rich);
- ``explain_view``: ``explain``'s tables and answers (rich), from ``dpverify.explain``;
- ``fuzz`` (the Hypothesis session and repro scripts) and ``fuzz_view`` (its live display);
- ``selftest``: the registry's DDP checks under torchrun or a local pool.
"""
