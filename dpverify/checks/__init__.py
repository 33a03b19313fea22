"""The DataParallel checks: ``dp``, ``buffers``, ``loss_average``, the assertion helpers
that ``dpverify.registry`` names and ``dpverify.planner`` runs over a model's splits.
"""
