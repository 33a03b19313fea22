"""The ``dpverify`` command line: everything that talks to a person.

- ``main``: the subcommands and the one mapping of errors to exit codes;
- ``user_model``: loading ``MODULE:FACTORY``, ``--inputs`` and inferring a batch;
- ``check_view``: ``check``'s progress, tables and explanations (rich);
- ``explain`` (measurement), ``explain_answers`` (prose), ``explain_view`` (rich);
- ``fuzz`` (the Hypothesis session and repro scripts) and ``fuzz_view`` (its live display);
- ``selftest``: the registry's DDP checks under torchrun or a local pool.
"""
