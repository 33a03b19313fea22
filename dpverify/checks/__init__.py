"""The DataParallel checks and the registry every front end runs.

- ``dp``, ``buffers``, ``loss_average``: the DataParallel assertion helpers;
- ``registry``: ``CHECKS``, each check as a ``CheckSpec`` with one ``CheckResult`` type, over
  the DataParallel helpers here and the DDP ones in ``dpverify.ddp``;
- ``model``: ``dpverify check``'s plan and run of the registry over a model's splits.
"""
