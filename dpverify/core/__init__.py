"""The engine: what every check is built from, with no opinion on what to check (the
virtual devices, the step, the comparison and its tolerance, the walker over nested
tensors, the one ``InvalidArgument`` and the argument checks, text for messages).

Nothing here imports rich, Hypothesis or the command line (``tests/test_layout.py``).
"""
