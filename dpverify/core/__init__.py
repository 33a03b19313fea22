"""The engine: what every check is built from, with no opinion on what to check.

- ``virtual``: ``VirtualDataParallel``, torch's DataParallel on virtual CPU devices, over
  the stand-ins of ``primitives``; ``patching``: the opt-in, process-wide switches of
  torch's own objects (``virtual_devices``); ``devices``: device ids and what CUDA offers;
- ``scatter``: torch's chunking rule and the plan of a call's arguments;
- ``step``: one forward/backward step (single-device or parallel), recorded;
- ``tree``: the one walker over nested tensors;
- ``comparison``: the float64-anchored tolerance and the per-tensor verdicts;
- ``divergence``: modules that legitimately differ in train mode (BatchNorm, Dropout);
- ``errors`` and ``validation``: the one ``InvalidArgument`` and the argument checks;
- ``text`` and ``tracebacks``: counts, shortened names and the user's frames, for messages.

Nothing here imports rich, Hypothesis or the command line (``tests/test_layout.py``).
"""
